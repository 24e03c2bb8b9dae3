"""The kv_connector names KVPP knows: ours, and vLLM's MultiConnector that combines them."""

MOONCAKE = "MooncakeConnectorV2"
STORE = "AscendStoreConnector"
MULTI = "MultiConnector"
