"""The megatron-core model of a vision-language family: a GPTModel with M-RoPE and a vision tower.

``VisionLanguageModel`` is megatron's ``GPTModel`` (decoder, output layer, TP/PP/SP unchanged) with:

* on the first pipeline stage, ``visual``: transformers' vision module (``megarl.models.vision``),
  replicated on every TP rank; its parameters are the model's (the optimizer, DDP, the loader, the export
  and the weight sync see them under ``visual.<HF name>``); ``freeze_vision_tower`` stops their gradients;
* M-RoPE (``megarl.models.mrope.MropeEmbedding``) in place of the 1-D RoPE: ``position_ids`` are
  ``[3, B, S]`` (``mrope_position_ids``), on every pipeline stage;
* the embedding: the word embeddings of ``input_ids`` with the images' features written over the image
  tokens in order (row by row, as transformers' ``masked_scatter``), then, under sequence parallelism,
  scattered over the TP ranks as megatron's own embedding output is;
* Qwen3-VL's DeepStack: the tower's extra features are added at the image tokens to the output of the
  first ``deepstack_layers`` decoder layers (forward hooks on those layers, which ``check_layout`` keeps on
  the first stage; the features of the last forward are kept until the next one, so activation
  recomputation of those layers sees them; ``build_model`` refuses full recomputation with DeepStack,
  under which a pipeline schedule would recompute one micro-batch with another's features).
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from megarl.models.dims import ModelDims
from megarl.models.mrope import MropeEmbedding
from megarl.models.vision import vision_module_class


class VisionLanguageModel(GPTModel):
    """See the module docstring. ``forward(input_ids [B, S], position_ids [3, B, S], attention_mask,
    pixel_values=[patches, C*T*P*P], image_grid_thw=[images, 3], image_mask=[B, S] or None, **GPTModel kwargs)``."""

    def __init__(self, config, spec, *, dims: ModelDims, vision_config, **kwargs):
        super().__init__(config, spec, scatter_embedding_sequence_parallel=False, **kwargs)
        from megarl.platform import device

        self.tower = dims.vision
        self.position_embedding_type = "mrope"  # GPTModel's M-RoPE branch, with megarl's embedding module
        self.mrope_section = list(dims.mrope.section)
        self.rotary_pos_emb = MropeEmbedding(dims.attention.head_dim, dims.rope.theta, self.mrope_section,
                                             dims.mrope.interleaved, device=device())
        self._deepstack: list[torch.Tensor] | None = None
        if self.pre_process:
            cls = vision_module_class(self.tower.module_class)
            visual = cls._from_config(vision_config, dtype=config.params_dtype, attn_implementation="sdpa")
            self.visual = visual.to(device())
            for layer in self.decoder.layers:
                index = layer.layer_number - 1  # global, 0-based
                if index < self.tower.deepstack_layers:
                    layer.register_forward_hook(self._deepstack_hook(index))

    def forward(self, input_ids, position_ids, attention_mask=None, decoder_input=None, *args,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, **kwargs):
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
              image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder input [S, B, H] (this rank's share of S under SP): words, then the images over their tokens
        (``image_mask [B, S]``; None: every image token id, see ``megarl.models.mrope.mrope_position_ids``)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H], all of S
        self._deepstack = None
        if pixel_values is not None:
            mask = input_ids == self.tower.image_token_id if image_mask is None else image_mask.bool()  # [B, S]
            features, deepstack = self.image_features(pixel_values, image_grid_thw)
            if int(mask.sum()) != features.shape[0]:
                raise ValueError(f"input_ids hold {int(mask.sum())} image tokens, the {image_grid_thw.shape[0]} images "
                                 f"give {features.shape[0]} features; expand each image to its grid's token count (and "
                                 "give image_mask, the prompt's image tokens, when a response holds the id as text)")
            embeddings = _scatter_rows(embeddings, mask, features)
            self._deepstack = [self._to_sequence_parallel(_scatter_rows(torch.zeros_like(embeddings), mask, extra))
                               for extra in deepstack]
        return self._to_sequence_parallel(embeddings)

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The tower's features of every image in order [image tokens, H], and its DeepStack features (Qwen3-VL)."""
        if image_grid_thw is None:
            raise ValueError("pixel_values need their image_grid_thw [images, 3] (the processor returns both)")
        dtype = next(self.visual.parameters()).dtype
        output = self.visual(pixel_values.to(dtype), grid_thw=image_grid_thw, return_dict=True)
        return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])

    def _to_sequence_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.config.sequence_parallel:
            return hidden
        return tensor_parallel.scatter_to_sequence_parallel_region(hidden).clone()

    def _deepstack_hook(self, index: int):
        def add_features(module, args, output):
            if not self._deepstack:  # no images in this batch
                return output
            hidden, *rest = output
            return (hidden + self._deepstack[index], *rest)

        return add_features


def _scatter_rows(embeddings: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``embeddings [S, B, H]`` with ``values`` written at ``mask [B, S]``, row by row (transformers' order)."""
    by_row = embeddings.transpose(0, 1).masked_scatter(mask[..., None], values.to(embeddings.dtype))
    return by_row.transpose(0, 1).contiguous()


def freeze_vision_tower(models: list, frozen: bool = True) -> int:
    """Stop (or restart) the gradients of the vision tower (verl's ``actor.freeze_vision_tower``); the number
    of tensors switched (0 on stages without the tower)."""
    from megarl.models.loading import unwrap

    count = 0
    for model in models:
        visual = getattr(unwrap(model), "visual", None)
        if visual is not None:
            for param in visual.parameters():
                param.requires_grad_(not frozen)
                count += 1
    return count
