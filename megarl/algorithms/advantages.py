"""Advantage estimators (`algorithm.adv_estimator`), with verl's names and definitions.

Every estimator takes keyword arguments and returns `(advantages, returns)`, both
`[batch, response_len]`, and may add a third element, a dict of metrics to log (SPIN's DPO
numbers). The inputs, with verl's names:

- `token_level_rewards` `[batch, response_len]`: rewards per token (outcome rewards sit on the
  last valid token; the outcome methods use the per-sample sum).
- `response_mask` `[batch, response_len]`: 1 for response tokens, 0 for padding.
- `index` (group methods): the prompt id of each sample (any hashable; a list, a numpy array of
  str or int, or a tensor). Samples with equal ids form a group.
- `values` `[batch, response_len]` (gae): critic values. `reward_baselines` `[batch]` (remax):
  the rewards of the greedy responses. `old_log_prob`, `ref_log_prob` `[batch, response_len]`
  (spin): the policy's and the reference's log-probs of the responses before the update.
- options: `gamma`, `lam`, `epsilon`, `norm_adv_by_std_in_grpo`; `sppo_eta` (sppo),
  `dpo_beta`, `dpo_loss_type`, `dpo_label_smoothing` (spin).

The trainer calls whichever estimator the config picked with one set of arguments:

    estimator = get_adv_estimator(cfg.algorithm.adv_estimator)
    advantages, returns = estimator(token_level_rewards=..., response_mask=..., index=..., values=...,
                                    gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)

Each estimator receives only the arguments it declares (see `registry.UniformCall`). A new one:

    @register_adv_estimator("my_estimator")
    def my_estimator(token_level_rewards, response_mask, index, epsilon=1e-6): ...

All estimators run under `torch.no_grad()` (advantages are constants), on any device.
Group statistics are vectorised over groups instead of verl's per-sample Python loop; the
arithmetic is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megarl.algorithms.masked import masked_whiten
from megarl.config.registry import Registry, UniformCall

# Traits: ``needs_values`` (a critic's values: the run trains a critic), ``grouped`` (compares the
# responses to one prompt: with rollout.n == 1 every advantage is 0), ``needs_greedy_baseline``
# (a greedy response per prompt is generated as its baseline, ReMax), ``needs_log_probs`` (reads the
# old and the reference log-probs: both passes run before it), ``loss`` (None, or the (policy loss,
# loss_agg_mode) its advantages are the gradient weights of, for one optimizer step per batch: SPIN).
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator",
                                traits={"needs_values": False, "grouped": False, "needs_greedy_baseline": False,
                                        "needs_log_probs": False, "loss": None})

# Inputs the trainer may pass to any estimator; an estimator that does not declare one ignores it.
SHARED_ESTIMATOR_INPUTS = frozenset(
    {
        "token_level_rewards", "response_mask", "index", "values", "reward_baselines",
        "gamma", "lam", "epsilon", "norm_adv_by_std_in_grpo",
        "old_log_prob", "ref_log_prob", "sppo_eta", "dpo_beta", "dpo_loss_type", "dpo_label_smoothing",
    }
)


def register_adv_estimator(name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register an advantage estimator under `name` (selected by `algorithm.adv_estimator`),
    with its traits (``needs_values``, ``grouped``, ``needs_greedy_baseline``, ``needs_log_probs``, ``loss``)."""
    return ADVANTAGE_ESTIMATORS.register(name, **traits)


def estimator_traits(name: str) -> dict[str, Any]:
    """What estimator `name` needs: ``needs_values``, ``grouped``, ``needs_greedy_baseline``, ``needs_log_probs``, ``loss``."""
    return ADVANTAGE_ESTIMATORS.traits(name)


def get_adv_estimator(name: str) -> UniformCall:
    """The estimator registered as `name`, callable with the shared keyword inputs."""
    return UniformCall("advantage estimator", name, ADVANTAGE_ESTIMATORS[name], SHARED_ESTIMATOR_INPUTS)


# ----------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class Groups:
    """Samples grouped by prompt id: `ids[i]` is the group number of sample i."""

    ids: torch.Tensor  # [batch] long, on the scores' device
    count: int
    members: list[list[int]]  # sample indices of each group, in batch order

    @staticmethod
    def from_index(index: Sequence[Any] | torch.Tensor, batch_size: int, device: torch.device) -> "Groups":
        if index is None:
            raise ValueError("this estimator groups samples by prompt: pass `index` (the prompt id of each sample)")
        if isinstance(index, torch.Tensor):
            index = index.tolist()  # tensor elements hash by identity, their values do not
        if len(index) != batch_size:
            raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} samples")
        number_of: dict[Any, int] = {}
        ids = [number_of.setdefault(key, len(number_of)) for key in index]
        members: list[list[int]] = [[] for _ in number_of]
        for sample, group in enumerate(ids):
            members[group].append(sample)
        return Groups(torch.tensor(ids, dtype=torch.long, device=device), len(number_of), members)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group sums of a `[batch]` tensor -> `[count]`."""
        return torch.zeros(self.count, dtype=values.dtype, device=values.device).index_add_(0, self.ids, values)

    def sizes(self, like: torch.Tensor) -> torch.Tensor:
        return self.sum(torch.ones_like(like))

    # Group statistics are computed in float64 and returned in the scores' dtype: in float32 the
    # mean of equal scores can miss them by one ulp, and divided by a std of the same ulp order a
    # group of identical rewards got advantages of 0.3 instead of 0 (found by hypothesis).
    def mean(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-group means; 0 for a group of one (verl's convention)."""
        wide = scores.double()
        sizes = self.sizes(wide)
        mean = self.sum(wide) / sizes
        return torch.where(sizes == 1, torch.zeros_like(mean), mean).to(scores.dtype)

    def std(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-group unbiased std (as torch.std); 1 for a group of one (verl's convention)."""
        wide = scores.double()
        sizes = self.sizes(wide)
        mean = self.sum(wide) / sizes
        squares = self.sum((wide - mean[self.ids]) ** 2)
        std = torch.sqrt(squares / torch.clamp(sizes - 1, min=1))
        return torch.where(sizes == 1, torch.ones_like(std), std).to(scores.dtype)


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]"
        )
    return token_level_rewards.sum(dim=-1), response_mask.to(token_level_rewards.dtype)


# ------------------------------------------------------------------------- estimators
@register_adv_estimator("gae", needs_values=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (arXiv:1506.02438), whitened over the batch.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where t+1 is
    the next *valid* token (masked positions are skipped: they carry V and A through unchanged).
    returns = A + V (before whitening); advantages = masked_whiten(A).
    """
    if values is None:
        raise ValueError("gae needs critic `values` [batch, response_len]; enable the critic or pick a critic-free estimator")
    _, mask = _outcome_scores(token_level_rewards, response_mask)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = gae * m + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


@register_adv_estimator("grpo", grouped=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (arXiv:2402.03300): A_i = (R_i - mean_group) / (std_group + epsilon) on every token.

    `norm_adv_by_std_in_grpo=False` drops the division (Dr. GRPO, arXiv:2503.20783). std is
    unbiased (torch.std); a group of one has mean 0 and std 1, so its advantage is R / (1 + eps).
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    advantages = scores - groups.mean(scores)[groups.ids]
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (groups.std(scores)[groups.ids] + epsilon)
    advantages = advantages.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_estimator("grpo_passk", grouped=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (as cited by verl: arXiv:2503.19595): only the best sample of each group
    gets a non-zero advantage, R_max - R_second_max (divided by std_group + epsilon when
    `norm_adv_by_std_in_grpo`). Every group needs at least 2 samples.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    advantages = torch.zeros_like(scores)
    for members in groups.members:
        if len(members) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per prompt; a group has {len(members)} (set rollout.n >= 2)")
        member_ids = torch.tensor(members, device=scores.device)
        rewards = scores[member_ids]
        top, top_position = torch.topk(rewards, 2)
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[members[int(top_position[0])]] = advantage
    advantages = advantages.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_estimator("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546), as verl's `gpg` estimator: A_i = alpha * (R_i - mean_group) / f_norm
    with alpha = batch size / number of samples with a non-zero reward (at least 1), which scales
    the gradient up when few samples are rewarded. No division by the group's std; a group of one
    has mean 0. Pair it with `policy_loss.loss_mode=gpg` (verl's name for megarl's `reinforce`).
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    advantages = alpha * (scores - groups.mean(scores)[groups.ids]) / f_norm
    advantages = advantages.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_estimator("rloo", grouped=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): A_i = R_i - mean of the *other* samples of the group,
    computed as n/(n-1) * (R_i - mean_group). A group of one keeps A_i = R_i.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    sizes = groups.sizes(scores)
    factor = torch.where(sizes > 1, sizes / torch.clamp(sizes - 1, min=1), torch.ones_like(sizes))[groups.ids]
    advantages = scores * factor - groups.mean(scores)[groups.ids] * factor
    advantages = advantages.unsqueeze(-1) * mask
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted returns G_t = r_t + gamma * G_{t+1} (reset
    after the end of each response), then whitened over the batch and masked.
    """
    _, mask = _outcome_scores(token_level_rewards, response_mask)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[-1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): R_i - mean_group on every token, then whitened
    over the whole batch and masked. A group of one has mean 0.
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    centred = (scores - groups.mean(scores)[groups.ids]).unsqueeze(-1) * mask
    advantages = masked_whiten(centred, mask) * mask
    return advantages, advantages


@register_adv_estimator("remax", needs_greedy_baseline=True)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): returns G_t = sum_{s>=t} r_s (masked); A_t = G_t - b, where b is
    the reward of the greedy response to the same prompt (`reward_baselines`, `[batch]`).
    """
    _, mask = _outcome_scores(token_level_rewards, response_mask)
    if reward_baselines is None or reward_baselines.shape != token_level_rewards.shape[:1]:
        got = None if reward_baselines is None else tuple(reward_baselines.shape)
        raise ValueError(f"remax needs reward_baselines of shape [batch]={tuple(token_level_rewards.shape[:1])}, got {got}")
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_estimator("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): A_i = R_i - b_group with the length-weighted baseline
    b = sum_j(L_j R_j) / sum_j(L_j), L_j the response length. A group of one has b = 0
    (so has a group whose responses are all empty).
    """
    scores, mask = _outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    lengths = mask.sum(dim=-1)
    weighted = groups.sum(lengths * scores)
    total_length = groups.sum(lengths)
    baseline = weighted / torch.where(total_length == 0, torch.ones_like(total_length), total_length)
    baseline = torch.where(groups.sizes(scores) == 1, torch.zeros_like(baseline), baseline)
    advantages = (scores - baseline[groups.ids]).unsqueeze(-1) * mask
    return advantages, advantages
