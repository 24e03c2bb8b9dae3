"""Names both connectors use: the kv_connector names KVPP knows (ours, and vLLM's MultiConnector that
combines them), and the key of a connector's own settings."""

MOONCAKE = "MooncakeConnectorV2"
STORE = "AscendStoreConnector"
MULTI = "MultiConnector"

EXTRA_CONFIG = "kv_connector_extra_config"
"""The kv_transfer_config key holding a connector's own settings: every settings problem's option starts here."""
