"""`space bench` (issue 12): what it prints, writes and refuses.

The real run goes through the CLI in a subprocess against the session's real installation (`real_cluster`:
control plane, node agent, root helper, runsc) with one sample of each operation (the hidden `--samples`);
stdout must parse as ONE JSON document. Timings are never asserted: a benchmark measures, tests assert
behaviour.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from bench import api_bench, api_report, api_spans, plain_runsc

from tests.support import cluster as c

real_cluster = c.real_cluster
REPO = pathlib.Path(__file__).resolve().parents[2]
SUMMARY_FIELDS = {"p50_ms", "p90_ms", "p99_ms", "max_ms", "n"}
CREATIONS = ("create_warm", "create_warm_c8", "create_cold")


def space_bench(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def bare_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """An environment that names no server: no SPACE_* variables, a HOME and config file that do not exist."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPACE_")}
    env["HOME"] = str(tmp_path / "home")
    env["SPACE_CONFIG"] = str(tmp_path / "no-such-config.json")
    return env


def live_sandboxes(cluster: c.RealCluster) -> set[str]:
    with cluster.sdk() as sp:
        return {sb.id for sb in sp.sandboxes.list() if sb.state != "deleted"}


@pytest.mark.root
def test_json_is_one_document_with_every_operation_and_the_chart_is_written(
    real_cluster: c.RealCluster, tmp_path: pathlib.Path
) -> None:
    before = live_sandboxes(real_cluster)
    scratch = pathlib.Path(plain_runsc.scratch_dir())
    copies_before = set(scratch.glob("space-bench-plain-*"))  # another run's may exist
    results = tmp_path / "results"
    env = bare_env(tmp_path)
    run = space_bench(
        "--url", real_cluster.url, "--api-key", real_cluster.api_key, "bench", "--json", "--samples", "1",
        "--node-url", f"http://127.0.0.1:{real_cluster.local.node_port}",
        "--node-data-dir", str(real_cluster.data_dir), "--results-dir", str(results), env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    doc: dict[str, Any] = json.loads(run.stdout)  # the whole of stdout is one document

    assert set(doc) == {*api_report.OPERATIONS, "ratios", "meta"}
    for name in api_report.OPERATIONS:
        row = doc[name]
        assert set(row) >= SUMMARY_FIELDS, name
        assert row["n"] == 1, name
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"], name
    for name in CREATIONS:
        origins = doc[name]["from"]
        assert sum(origins.values()) == 1, origins
        assert set(origins) <= {"pool", "warm", "cold", "unknown"}, origins
    explained = set(api_report.OPERATIONS) - {"create_plain_runsc", "exec_true_node"}
    for name in explained:  # where the milliseconds go (ADR 0072): span name -> median ms
        spans = doc[name].get("spans")
        assert spans and all(ms > 0 for ms in spans.values()), (name, spans)
    assert "node.rpc POST /sandboxes/{id}/exec" in doc["exec_true"]["spans"], doc["exec_true"]["spans"]
    assert "spaced.process.start" in doc["exec_true"]["spans"]
    assert any(n.startswith("helper.") for n in doc["create_cold"]["spans"]), doc["create_cold"]["spans"]
    assert "where the milliseconds go" in run.stderr
    assert set(doc["ratios"]) == set(api_report.RATIOS)
    assert doc["ratios"]["exec_api_vs_node"] == round(
        doc["exec_true"]["p50_ms"] / doc["exec_true_node"]["p50_ms"], 3
    )
    meta = doc["meta"]
    assert meta["target"] == real_cluster.url
    assert meta["cores"] == os.cpu_count()
    assert meta["samples_override"] == 1
    assert meta["embedded"] is False
    assert real_cluster.api_key not in run.stdout

    written = sorted(results.glob("api-2*.json"))
    assert len(written) == 1
    assert json.loads(written[0].read_text()) == doc
    assert json.loads((results / "api-latest.json").read_text()) == doc
    chart = written[0].with_suffix(".png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib is installed by `make setup`
    assert "create_warm" in run.stderr  # the table and the progress went to stderr
    assert live_sandboxes(real_cluster) == before, "the benchmark left sandboxes behind"
    left = set(scratch.glob("space-bench-plain-*")) - copies_before
    assert not left, f"the baseline left its copies: {left}"


@pytest.mark.root
def test_a_key_the_server_refuses_is_one_line_and_exit_code_5(
    real_cluster: c.RealCluster, tmp_path: pathlib.Path
) -> None:
    key = "sk_wrong_" + "x" * 40
    run = space_bench("--url", real_cluster.url, "--api-key", key, "bench", "--json", env=bare_env(tmp_path))
    assert run.returncode == 5, (run.returncode, run.stderr)
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unauthenticated: "), run.stderr
    assert key not in run.stderr


def test_no_server_and_no_embedded_is_one_line_and_exit_code_2(tmp_path: pathlib.Path) -> None:
    run = space_bench("bench", "--json", env=bare_env(tmp_path))
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no server configured" in lines[0], (
        run.stderr
    )


def test_an_unreachable_server_is_one_line_and_exit_code_6(tmp_path: pathlib.Path) -> None:
    env = {**bare_env(tmp_path), "SPACE_URL": f"http://127.0.0.1:{c.free_port()}", "SPACE_API_KEY": "k"}
    run = space_bench("bench", "--json", env=env, timeout=300)
    assert run.returncode == 6, (run.returncode, run.stderr)
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("error: transport_error: ")


def test_samples_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        api_bench.main(["--samples", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().out == ""


def test_the_target_in_meta_carries_no_secret() -> None:
    url = "https://user:s3cret@space.example.com:8443/base/?api_key=s3cret#s3cret"
    assert api_report.public_url(url) == "https://space.example.com:8443/base/"
    assert api_report.public_url("http://[::1]:8470") == "http://[::1]:8470"
    assert "s3cret" not in json.dumps(api_report.meta(target=url, embedded=False, quick=True, samples=None))


def test_ratios_are_of_p50s_and_left_out_when_a_side_is_missing() -> None:
    samples = {"create_warm": [10.0, 20.0, 30.0], "create_cold": [100.0, 200.0, 300.0], "exec_true": [5.0]}
    doc = api_report.document(samples, {"create_warm": {"from": {"pool": 3}}}, {"quick": True})
    assert doc["ratios"] == {"create_warm_vs_cold": 0.1}
    assert doc["create_warm"] == {
        "p50_ms": 20.0, "p90_ms": 30.0, "p99_ms": 30.0, "max_ms": 30.0, "n": 3, "from": {"pool": 3}
    }  # fmt: skip
    assert "create_plain_runsc" not in doc and "exec_true_node" not in doc


def test_the_chart_is_skipped_with_a_note_without_matplotlib(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    path = tmp_path / "chart.png"
    assert api_report.write_chart({"exec_true": [1.0, 2.0]}, path, "t") is None
    assert not path.exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "matplotlib is not installed" in captured.err


def test_a_span_breakdown_is_each_name_s_median_over_the_samples_windows() -> None:
    def trace(start: int, *spans: tuple[str, int]) -> dict[str, Any]:
        return {
            "spans": [{"name": n, "start_ns": start, "end_ns": start + ms * 1_000_000} for n, ms in spans]
        }

    traces = [
        trace(100, ("POST exec", 10), ("node.rpc", 6)),
        trace(150, ("GET poll", 2)),  # the same sample's poll
        trace(300, ("POST exec", 20), ("node.rpc", 8)),
        trace(500, ("POST exec", 30), ("node.rpc", 9)),
        trace(900, ("POST exec", 99)),  # in no window: not counted
    ]
    windows = [(90, 200), (290, 310), (490, 510), (600, 700)]  # the last window kept no trace
    samples = api_spans.sample_breakdowns(traces, windows)
    assert samples == [
        {"POST exec": 10.0, "node.rpc": 6.0, "GET poll": 2.0},
        {"POST exec": 20.0, "node.rpc": 8.0},
        {"POST exec": 30.0, "node.rpc": 9.0},
    ]
    breakdown = api_spans.median_breakdown(samples)
    assert breakdown == {"POST exec": 20.0, "node.rpc": 8.0}  # GET poll: median of (2, 0, 0) is 0: left out
    assert list(api_spans.median_breakdown(samples, top=1)) == ["POST exec"]
    doc = api_report.document({"exec_true": [1.0, 2.0]}, {"exec_true": {"spans": breakdown}}, {})
    out = io.StringIO()
    api_report.print_table(doc, out)
    assert "exec_true            POST exec 20.0, node.rpc 8.0" in out.getvalue()
