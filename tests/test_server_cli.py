"""`lowvram serve` options, network exposure rules, and the metrics text format."""

import argparse
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowvram.errors import ConfigError
from lowvram.server.cli import add_serve_parser, bind_socket, check_exposure, cmd_serve, is_loopback, served_name
from lowvram.server.metrics import Histogram, ServerMetrics


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="lowvram")
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback_port_8000_without_a_key(monkeypatch):
    monkeypatch.delenv("LOWVRAM_API_KEY", raising=False)
    args = _parse()
    assert (args.host, args.port, args.api_key, args.insecure_no_auth, args.model) == (
        "127.0.0.1",
        8000,
        None,
        False,
        None,
    )
    assert args.func is cmd_serve


def test_the_api_key_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOWVRAM_API_KEY", "from-env")
    assert _parse().api_key == "from-env"
    assert _parse("--api-key", "given").api_key == "given"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    check_exposure(host, None, False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "my-server.example"])
def test_other_hosts_need_a_key_or_an_explicit_insecure_flag(host):
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match="--api-key.*--insecure-no-auth"):
        check_exposure(host, None, False)
    check_exposure(host, "key", False)
    check_exposure(host, None, True)


def test_serve_refuses_an_unprotected_public_host_before_loading_anything(tmp_path):
    args = _parse("--host", "0.0.0.0", "--model", str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match="--insecure-no-auth"):
        cmd_serve(args)


def test_serve_rejects_a_non_positive_queue(tmp_path):
    with pytest.raises(ConfigError, match="--max-queue"):
        cmd_serve(_parse("--max-queue", "0", "--model", str(tmp_path)))


def test_a_taken_port_is_a_config_error_naming_the_port():
    taken = bind_socket("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"{port}.*--port"):
            bind_socket("127.0.0.1", port)
    finally:
        taken.close()


def test_bound_sockets_are_tcp_so_responses_are_not_delayed_by_nagle():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_histogram_buckets_are_cumulative_and_end_with_inf():
    hist = Histogram("x_seconds", "help", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        hist.observe(value)
    lines = hist.render()
    assert 'x_seconds_bucket{le="0.1"} 2' in lines
    assert 'x_seconds_bucket{le="1"} 3' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4' in lines
    assert "x_seconds_count 4" in lines and "x_seconds_sum 7.65" in lines


def test_metrics_escape_label_values_and_count_controller_decisions():
    metrics = ServerMetrics('model "quoted"\\name')
    snapshot = SimpleNamespace(
        num_kv_blocks=10,
        num_kv_blocks_used=6,
        num_kv_blocks_on_host=2,
        kv_block_size=16,
        kv_precision="int8",
        num_running=3,
        num_waiting=1,
        decode_tokens_per_s=12.5,
        controller_mode="pressure",
        last_decision=None,
        memory_used_bytes=100,
        memory_budget_bytes=200,
    )
    for decision in ("kv->int8", "kv->int8", "spill", "spill", "kv->int8"):
        snapshot.last_decision = decision
        metrics.observe_snapshot(snapshot)
    text = metrics.render(snapshot, num_in_flight=4, max_queue=8)
    assert 'lowvram_model_info{model="model \\"quoted\\"\\\\name"} 1' in text
    assert 'lowvram_controller_events_total{decision="kv->int8"} 2' in text
    assert 'lowvram_controller_events_total{decision="spill"} 1' in text
    assert 'lowvram_kv_pages{location="device"} 4' in text and 'lowvram_kv_pages{location="host"} 2' in text
    assert 'lowvram_kv_precision_info{precision="int8"} 1' in text
    assert 'lowvram_controller_mode_info{mode="pressure"} 1' in text
    assert "lowvram_batch_size 3" in text and "lowvram_queue_depth 1" in text
    assert "lowvram_decode_tokens_per_second 12.5" in text


def test_a_gguf_file_is_served_under_its_own_name():
    converted = Path("/cache/gguf/SmolLM2-135M-Instruct.Q4_1-98362432-b179c9523d0e6a0f")
    assert served_name("models/SmolLM2-135M-Instruct.Q4_1.gguf", converted) == "SmolLM2-135M-Instruct.Q4_1"
    assert served_name("/models/deepseek-coder-1.3b", Path("/models/deepseek-coder-1.3b")) == "deepseek-coder-1.3b"
    assert served_name(None, Path("/pkg/demo_model")) == "demo_model"
