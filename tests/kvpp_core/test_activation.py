"""The start-up proof's checks: each way a worker can lack KVPP is refused with its worker class, its
platform and the fix; a group whose ranks do not own every layer exactly once is refused; the reports
of a real layout pass."""

from dataclasses import replace

import pytest

from kvpp_core.activation import KvppActivationError, WorkerProof, refuse_unless_active
from kvpp_core.ownership import rank_layout

pytestmark = pytest.mark.unit

PATCHED = ("vllm.v1.worker.gpu_worker.Worker", "vllm.v1.worker.cpu_worker.CPUWorker")
LAYERS = tuple(range(16))


def _proof(rank: int, group: tuple[int, ...] = (0, 1), pp_rank: int = 0) -> WorkerProof:
    """What a correctly set-up worker of a TP2 group reports (its layout from the real ownership split)."""
    layout = rank_layout(LAYERS, len(group), group.index(rank))
    return WorkerProof(rank, "vllm.v1.worker.cpu_worker.CPUWorker", "cpu", active=True, pp_rank=pp_rank,
                       kvpp_rank=layout.kvpp_rank, group_size=layout.group_size, group_ranks=group,
                       target_layers=layout.target_layers, owned=layout.owned, staging_slots=layout.staging_slots,
                       staging_needed=layout.staging_slots, transport="shared memory", transport_size=len(group),
                       capacity_planned=True)


def _refusal(proofs, world: int | None = None) -> str:
    with pytest.raises(KvppActivationError) as err:
        refuse_unless_active(proofs, len(proofs) if world is None else world, PATCHED)
    return str(err.value)


def test_a_correct_group_passes():
    refuse_unless_active([_proof(0), _proof(1)], 2, PATCHED)
    # two groups (TP2 x PP2): each owns its own layers
    refuse_unless_active([_proof(r, (0, 1) if r < 2 else (2, 3), r // 2) for r in range(4)], 4, PATCHED)


def test_an_unpatched_worker_class_is_named_with_its_platform_and_what_is_supported():
    custom = WorkerProof(1, "my.pkg.MyWorker", "cpu", unpatched=("initialize_from_config", "execute_model"))
    message = _refusal([_proof(0), custom])
    assert "worker rank 1 (my.pkg.MyWorker on platform cpu) overrides initialize_from_config, execute_model" in message
    assert "the KVPP adapter patches vllm.v1.worker.gpu_worker.Worker, vllm.v1.worker.cpu_worker.CPUWorker" in message
    assert 'remove "enable_kvpp" from --additional-config' in message
    assert "worker rank 0" not in message  # the good rank is not blamed


def test_a_worker_without_the_runtime_is_refused_even_when_its_class_looks_patched():
    message = _refusal([WorkerProof(0, "vllm_ascend.worker.worker.NPUWorker", "npu")], world=1)
    assert "worker rank 0 (vllm_ascend.worker.worker.NPUWorker on platform npu) allocated its KV cache without KVPP" \
        in message


@pytest.mark.parametrize("change, expected", [
    (dict(bound_problem="KVPP: cache model.layers.3.self_attn.attn is not bound at its planned offset 0"),
     "worker rank 1 (vllm.v1.worker.cpu_worker.CPUWorker on platform cpu): KVPP: cache model.layers.3"),
    (dict(staging_slots=1), "has 1 staging buffer(s) bound but its layout needs 2"),
    (dict(transport=None, transport_size=None), "broadcast transport missing reaches None rank(s), its group has 2"),
    (dict(transport_size=1), "broadcast transport shared memory reaches 1 rank(s), its group has 2"),
    (dict(capacity_planned=False), "determine_available_memory did not run KVPP's version"),
])
def test_each_missing_part_of_an_active_worker_is_refused(change, expected):
    assert expected in _refusal([_proof(0), replace(_proof(1), **change)])


def test_a_group_must_own_every_layer_exactly_once():
    lost = replace(_proof(1), owned=_proof(1).owned[1:])
    assert "target layers [8] have no owner" in _refusal([_proof(0), lost])
    doubled = replace(_proof(1), owned=(7, *_proof(1).owned))
    assert "{7: [0, 1]} more than one" in _refusal([_proof(0), doubled])


def test_a_missing_or_misnumbered_rank_is_refused():
    assert "1 of the engine's 2 workers reported" in _refusal([_proof(0)], world=2)
    same_rank = replace(_proof(1), kvpp_rank=0)
    assert "kvpp ranks [0, 0]; expected one report per rank, kvpp ranks 0..1" in _refusal([_proof(0), same_rank])
