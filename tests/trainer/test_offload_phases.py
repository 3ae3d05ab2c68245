"""Which state each worker phase keeps on the device, on plain torch modules (no processes).

The megatron side (DDP grad buffers, the distributed optimizer, a training step after the round
trip) is tested in tests/engine/test_engine_memory.py; here the phase table and the residency
bookkeeping: what moves, what stays, and that the bytes come back unchanged.
"""
from types import SimpleNamespace

import torch

from megarl.checks import load_config
from megarl.engine.offload_phases import PHASES, rank_residency
from megarl.settings.engine import offload_flags


def engines():
    torch.manual_seed(0)
    actor_model, ref_model = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    adam = torch.optim.Adam(actor_model.parameters(), lr=0.1)
    actor_model(torch.randn(2, 8)).sum().backward()
    adam.step()  # real Adam state: exp_avg, exp_avg_sq, step
    actor = SimpleNamespace(model=[actor_model], optimizer=SimpleNamespace(optimizer=adam))
    ref = SimpleNamespace(runner=SimpleNamespace(chunks=[ref_model]))
    return actor, ref


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_each_phase_keeps_only_what_it_uses():
    cfg = load_config(None, ["data.train_files=x", "actor_rollout_ref.model.path=/m",
                             "actor_rollout_ref.actor.megatron.param_offload=true",
                             "actor_rollout_ref.actor.megatron.optimizer_offload=true"], validate=False)
    flags = offload_flags(cfg)
    assert flags["ref.params"] and not flags["actor.grads"] and not flags["critic.params"]  # ref follows the actor
    actor, ref = engines()
    actor_params, ref_params = list(actor.model[0].parameters()), list(ref.runner.chunks[0].parameters())
    state = [v for s in actor.optimizer.optimizer.state.values() for v in s.values()]
    before = [t.clone() for t in actor_params + ref_params + state]
    actor_storages = [p.untyped_storage() for p in actor_params]
    residency = rank_residency({"actor": actor, "ref": ref, "critic": None}, flags, rank=0)
    assert set(residency.resident()) == {"actor.params", "actor.optimizer", "ref.params"}  # only what has offload on

    residency.need(PHASES["ref"], "ref")
    assert all(s.nbytes() == 0 for s in actor_storages)  # the actor's weights left their storage...
    assert all(torch.equal(p, b) for p, b in zip(actor_params, before))  # ...and are readable in host memory
    assert storage_bytes(ref_params) > 0
    assert residency.resident() == {"actor.params": False, "actor.optimizer": False, "ref.params": True}
    residency.need(PHASES["update_actor"], "update_actor")
    assert residency.resident() == {"actor.params": True, "actor.optimizer": True, "ref.params": False}
    assert [p.untyped_storage()._cdata for p in actor_params] == [s._cdata for s in actor_storages]  # back in place
    residency.need(PHASES["sync"], "sync")
    assert residency.resident() == {"actor.params": True, "actor.optimizer": False, "ref.params": False}
    residency.need(PHASES["rollout"], "rollout")
    assert not any(residency.resident().values())
    with residency.also(("ref.params",), "export"):
        assert residency.resident()["ref.params"]
    assert not any(residency.resident().values())
    residency.need(PHASES["load"], "load")
    assert all(residency.resident().values())
    after = actor_params + ref_params + [v for s in actor.optimizer.optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
