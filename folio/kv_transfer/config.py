"""KVTransferConfig: vLLM's ``kv_transfer_config`` fields, validated, and where a request's blocks are sent.

Pure Python (the CLI, the server and the engine core read it). Every error is a ValueError that names the field as
``kv_transfer_config.<field>``. Roles (vLLM's names): a ``kv_producer`` (prefill instance) pushes a finished
prompt's blocks to a consumer; a ``kv_consumer`` (decode instance) runs a receiver on ``kv_ip:kv_port`` and finds the
received blocks by hash as prefix-cache hits; ``kv_both`` does both. For a producer, ``kv_ip:kv_port`` is the
default consumer (a request's ``kv_transfer_params`` may name another); for a consumer it is where it listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from folio.config_dict import config_kwargs

KV_CONNECTORS = ("TcpConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_BUFFER_SIZE = 10**9  # bytes, vLLM's default


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int | None = None
    kv_buffer_size: int = DEFAULT_KV_BUFFER_SIZE  # the consumer's store of received blocks, in bytes

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, got {self.kv_ip!r}")
        if self.kv_port is not None and not _is_port(self.kv_port):
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in [1, 65535], got {self.kv_port!r}")
        if self.is_consumer and self.kv_port is None:
            raise ValueError(
                f"kv_transfer_config.kv_port is required for kv_role {self.kv_role!r} (the port it receives on)"
            )
        buffer_size: object = self.kv_buffer_size
        if isinstance(buffer_size, float) and buffer_size.is_integer():  # vLLM's JSON often says 1e9
            self.kv_buffer_size = buffer_size = int(buffer_size)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be an integer >= 1 (bytes), got {buffer_size!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def default_destination(self) -> tuple[str, int] | None:
        """Where a producer sends when a request names no consumer: its kv_ip:kv_port (kv_producer only: a kv_both
        instance's own address is its receiver)."""
        if self.kv_role == "kv_producer" and self.kv_port is not None:
            return self.kv_ip, self.kv_port
        return None

    @staticmethod
    def from_value(value: KVTransferConfig | dict[str, object] | None) -> KVTransferConfig | None:
        """From EngineArgs' field: a config, a dict of its fields (as the CLI's JSON gives), or None (off)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return KVTransferConfig(**config_kwargs("kv_transfer_config", value, KVTransferConfig))


def check_kv_transfer_combinations(
    enable_prefix_caching: bool,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    speculative_method: str | None,
    model_impl: str,
) -> None:
    """What a kv_transfer_config does not run with (yet), as a ValueError naming the other flag."""
    if not enable_prefix_caching:
        raise ValueError("kv_transfer_config needs enable_prefix_caching: received blocks are found by their hash")
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        flag = "tensor_parallel_size" if tensor_parallel_size > 1 else "pipeline_parallel_size"
        raise ValueError(
            f"kv_transfer_config with {flag} > 1 is not supported yet: each rank holds only its own KV heads or "
            "layers, and the transfer sends whole blocks from one rank"
        )
    if speculative_method == "draft_model":
        raise ValueError("kv_transfer_config with speculative_config method 'draft_model' is not supported yet")
    if model_impl == "noop":
        raise ValueError("kv_transfer_config needs a real model, not model_impl 'noop' (it keeps no K/V)")


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def send_destination(
    kv_transfer_params: dict[str, Any] | None, config: KVTransferConfig | None
) -> tuple[str, int] | None:
    """Where a request's prompt blocks go: None unless it asks for ``do_remote_decode`` on a producer; then its
    ``remote_host`` / ``remote_port`` (host default: the config's kv_ip), else the config's default consumer."""
    if not kv_transfer_params or not kv_transfer_params.get("do_remote_decode"):
        return None
    if config is None or not config.is_producer:
        return None
    port = kv_transfer_params.get("remote_port")
    if port is not None:
        return str(kv_transfer_params.get("remote_host") or config.kv_ip), int(port)
    return config.default_destination
