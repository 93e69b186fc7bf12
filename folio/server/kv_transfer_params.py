"""vLLM's ``kv_transfer_params`` request field (disaggregated prefill, folio/kv_transfer/): its shape, its checks
against the server's kv_transfer_config (400 naming the field), and what the response says back.

``do_remote_decode`` (to a producer, the proxy's prefill copy): after the prompt, push its blocks to the consumer at
``remote_host:remote_port`` (default: the producer's kv_transfer_config). Its response's ``kv_transfer_params`` say
where they went (``do_remote_prefill``, ``remote_host``, ``remote_port``), which the proxy hands to the decode
request as vLLM's proxies do. ``do_remote_prefill`` (to a consumer): the prompt's blocks were pushed here; they are
found by hash, and a prompt whose blocks did not arrive is simply computed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from folio.kv_transfer.config import KVTransferConfig, send_destination
from folio.server.errors import bad_request

_PORT = "kv_transfer_params.remote_port"


class KVTransferParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = Field(default=None, min_length=1, max_length=255)
    remote_port: int | None = Field(default=None, ge=1, le=65535)


def kv_transfer_args(
    params: KVTransferParams | None, config: KVTransferConfig | None, use_beam_search: bool
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(SamplingParams.extra_args, the response's kv_transfer_params) for a request's field; a 400 naming the part
    of it that this server cannot do."""
    if params is None:
        return None, None
    if params.do_remote_prefill and (config is None or not config.is_consumer):
        raise bad_request(
            "kv_transfer_params.do_remote_prefill needs a server started with --kv-transfer-config whose kv_role is "
            "kv_consumer or kv_both",
            param="kv_transfer_params.do_remote_prefill",
        )
    if not params.do_remote_decode:
        return None, None
    if config is None or not config.is_producer:
        raise bad_request(
            "kv_transfer_params.do_remote_decode needs a server started with --kv-transfer-config whose kv_role is "
            "kv_producer or kv_both",
            param="kv_transfer_params.do_remote_decode",
        )
    if use_beam_search:
        raise bad_request(
            "kv_transfer_params.do_remote_decode is not supported with use_beam_search",
            param="kv_transfer_params.do_remote_decode",
        )
    if params.remote_host is not None and params.remote_port is None:
        raise bad_request("kv_transfer_params.remote_port is required with remote_host", param=_PORT)
    destination = send_destination(params.model_dump(exclude_none=True), config)
    if destination is None:
        raise bad_request(
            "kv_transfer_params.remote_port is required: this server's kv_transfer_config names no consumer (kv_port)",
            param=_PORT,
        )
    host, port = destination
    sent = {"do_remote_decode": True, "remote_host": host, "remote_port": port}
    return {"kv_transfer_params": sent}, {**sent, "do_remote_decode": False, "do_remote_prefill": True}
