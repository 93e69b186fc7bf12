"""kv_transfer_config (vLLM's fields) and where a request's blocks go: every refusal names the field and the limit."""

from __future__ import annotations

import pytest

from folio.cli import main
from folio.config import EngineArgs
from folio.kv_transfer.config import KVTransferConfig, send_destination

TCP = {"kv_connector": "TcpConnector"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({**TCP, "kv_role": "kv_sender"}, "kv_transfer_config.kv_role must be one of ['kv_producer', 'kv_consumer',"),
        ({"kv_role": "kv_producer"}, "kv_transfer_config.kv_connector must be one of ['TcpConnector'], got None"),
        ({**TCP, "kv_role": "kv_consumer"}, "kv_transfer_config.kv_port is required for kv_role 'kv_consumer'"),
        ({**TCP, "kv_role": "kv_both"}, "kv_transfer_config.kv_port is required for kv_role 'kv_both'"),
        ({**TCP, "kv_role": "kv_producer", "kv_port": 70000}, "kv_port must be an integer in [1, 65535], got 70000"),
        ({**TCP, "kv_role": "kv_producer", "kv_port": True}, "kv_port must be an integer in [1, 65535], got True"),
        ({**TCP, "kv_role": "kv_producer", "kv_ip": ""}, "kv_transfer_config.kv_ip must be a host name or address"),
        ({**TCP, "kv_role": "kv_producer", "kv_buffer_size": 0}, "kv_buffer_size must be an integer >= 1 (bytes)"),
        ({**TCP, "kv_role": "kv_producer", "kv_buffer_size": 1.5}, "kv_buffer_size must be an integer >= 1"),
        ({**TCP, "kv_role": "kv_producer", "kv_rank": 0}, "kv_transfer_config has unknown fields ['kv_rank']"),
        ("kv_producer", "kv_transfer_config must be a JSON object"),
    ],
)
def test_bad_config_names_the_field(value: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        KVTransferConfig.from_value(value)  # type: ignore[arg-type]
    assert message in str(error.value)


def test_roles_and_defaults() -> None:
    consumer = KVTransferConfig.from_value({**TCP, "kv_role": "kv_consumer", "kv_port": 14579, "kv_buffer_size": 1e9})
    assert consumer is not None and consumer.kv_buffer_size == 10**9 and isinstance(consumer.kv_buffer_size, int)
    assert (consumer.is_consumer, consumer.is_producer, consumer.kv_ip) == (True, False, "127.0.0.1")
    producer = KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_producer", kv_ip="10.0.0.5", kv_port=9)
    both = KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_both", kv_port=9)
    assert producer.default_destination == ("10.0.0.5", 9) and both.default_destination is None
    decode = {"do_remote_decode": True}
    assert send_destination(decode, producer) == ("10.0.0.5", 9)
    assert send_destination({**decode, "remote_port": 12}, producer) == ("10.0.0.5", 12)
    assert send_destination({**decode, "remote_host": "h", "remote_port": 12}, both) == ("h", 12)
    assert send_destination(decode, both) is None  # kv_both's own address is its receiver
    assert send_destination({"do_remote_prefill": True}, producer) is None
    assert send_destination(decode, consumer) is None and send_destination(decode, None) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"enable_prefix_caching": False}, "kv_transfer_config needs enable_prefix_caching"),
        ({"tensor_parallel_size": 2}, "kv_transfer_config with tensor_parallel_size > 1 is not supported yet"),
        ({"pipeline_parallel_size": 2}, "kv_transfer_config with pipeline_parallel_size > 1 is not supported yet"),
        ({"model_impl": "noop"}, "kv_transfer_config needs a real model, not model_impl 'noop'"),
        (
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2, "model": "m"}},
            "kv_transfer_config with speculative_config method 'draft_model' is not supported yet",
        ),
    ],
)
def test_combinations_refused_at_start(args: dict[str, object], message: str) -> None:
    engine_args = EngineArgs(kv_transfer_config={**TCP, "kv_role": "kv_producer"}, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_transfer_config") as error:
        engine_args.create_engine_config("model", 2048)
    assert message in str(error.value)


def test_folio_serve_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any process starts or the model loads."""
    bad = '{"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}'
    assert main(["serve", "--kv-transfer-config", bad]) == 2
    assert "folio: error: kv_transfer_config.kv_port is required for kv_role 'kv_consumer'" in capsys.readouterr().err
    producer = '{"kv_connector": "TcpConnector", "kv_role": "kv_producer"}'
    assert main(["serve", "--kv-transfer-config", producer, "--data-parallel-size", "2"]) == 2
    assert "kv_transfer_config with data_parallel_size (--data-parallel-size) > 1" in capsys.readouterr().err
    assert main(["proxy", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "--prefill must be an http:// or https:// URL" in capsys.readouterr().err
