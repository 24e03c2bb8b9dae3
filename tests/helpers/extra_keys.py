"""Per-block extra keys in the shapes vLLM 0.32 produces (checked against vLLM in
tests/connectors/store/test_request_keys.py), here so that child processes can import them."""

from __future__ import annotations

EXTRAS = [(("lora", "l", "/p"), ("mm", "img1", 3), ("cache_salt", "s"), ("prompt_embeds", b"\x00\xff" * 16)),
          (("lora", "l", "/p"), ("mm", "img1", -13)), None]
