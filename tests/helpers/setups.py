"""KVPP setups for the validation tests of kvpp_core and of the connectors' launch rules."""

from kvpp_core.config import KvppConfig
from kvpp_core.model import PRESETS
from kvpp_core.setup import KvppSetup
from kvpp_core.topology import Topology
from kvpp_core.validation import validate as validate_with

from connectors.launch import connector_rules

ON = KvppConfig(enabled=True)
POOL = {"backend": "mooncake", "lookup_rpc_port": 6000}
GOOD_STORE_EXTRA = {**POOL, "use_layerwise": False, "load_async": True, "discard_partial_chunks": True}


def setup(**overrides) -> KvppSetup:
    fields = dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8), enforce_eager=True, kvpp=ON)
    fields.update(overrides)
    return KvppSetup(**fields)


def validate(s: KvppSetup):
    """KVPP's rules and the connectors', as the launch check applies them."""
    return validate_with(s, connector_rules)


def only(problems):
    assert len(problems) == 1, problems
    return problems[0]
