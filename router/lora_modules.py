"""The LoRA adapters requests may name as their `model`: the server's --lora-modules, and, where
runtime updating is allowed (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), those loaded and unloaded
over HTTP with vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

A module here is a name for a directory; the engine replicas load its weights when a request
first names it (engine.lora). Each one loaded at run time gets a random id of its own, above the
--lora-modules' 1..n, so that no engine replica takes it for an adapter it loaded before (from
an earlier registry: this ingress replica restarted) and its prefix-cache blocks are its own (a
`load_inplace` of the same directory with new weights included). The registry is this ingress
replica's: runtime updating is refused at start-up with more than one ingress replica.
"""
from __future__ import annotations

import secrets
from collections.abc import Iterator

from pydantic import Field

from engine.errors import InvalidRequestError
from engine.lora_request import LoRARequest, ModelDims, check_adapter
from router.errors import OpenAIError, bad_request
from router.off_loop import off_loop
from router.protocol import _Model


RUNTIME_IDS = 1 << 32  # the first id a module loaded at run time may get


class LoadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # vLLM's: a name already loaded takes the new directory


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name is what identifies the module here


class LoRAModules:
    """Name -> LoRARequest, as a read-only mapping for the request paths, plus `load` / `unload`."""

    def __init__(self, modules: tuple[LoRARequest, ...], reserved: tuple[str, ...], max_rank: int,
                 dims: ModelDims | None = None) -> None:
        self.by_name = {m.lora_name: m for m in modules}
        self.reserved = set(reserved)  # the served model's names: no module may take one
        self.max_rank = max_rank
        self.dims = dims  # the model's shapes, which a module's weights must fit (None: the engine checks)

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.by_name))

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """vLLM's load: the directory checked as --lora-modules checks it (400 naming why)."""
        name = req.lora_name
        if name in self.reserved:
            raise bad_request(f"The name '{name}' is the served model's; a LoRA adapter needs another.",
                              param="lora_name")
        if name in self.by_name and not req.load_inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            lora = LoRARequest(name, RUNTIME_IDS + secrets.randbits(62), req.lora_path)
            await off_loop(check_adapter, lora.lora_path, self.max_rank, self.dims)
        except InvalidRequestError as e:
            raise bad_request(e.message, param="lora_path") from None
        self.by_name[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """vLLM's unload: requests stop naming it; ones already running finish with it."""
        if self.by_name.pop(req.lora_name, None) is None:
            raise OpenAIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                              code="model_not_found")
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
