"""`jaxserve client ...` against the test server, and `jaxserve serve` end to end in a
subprocess: warm-up before SERVING, then a graceful drain on SIGTERM."""
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import jsonschema
import pytest

from jaxserve.server.cli import main

from .conftest import IDS_A, http_call
from .constrained import COMPACT, SCHEMA, UNIT
from .serve_process import serve_args, server_env


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_client_cli(served, cases, capsys):
    t = served.target
    code, out, err = run_cli(capsys, "client", "--target", t, "health")
    assert code == 0 and out.strip() == "SERVING"
    code, out, _ = run_cli(capsys, "client", "--target", t, "info")
    assert code == 0 and json.loads(out)["architecture"] == "LlamaForCausalLM"
    prompt, kw, want = cases["text_greedy"]
    for extra in ([], ["--stream"]):
        code, out, err = run_cli(capsys, "client", "--target", t, "generate", prompt, "--max-tokens",
                                 str(kw["max_tokens"]), "--no-chat-template", *extra)
        assert code == 0 and out.rstrip("\n") == want.text and want.finish_reason in err
    code, out, _ = run_cli(capsys, "client", "--target", t, "tokenize", "Hello world")
    assert code == 0 and [int(x) for x in out.split()] == served.client.tokenize("Hello world")
    code, _, err = run_cli(capsys, "client", "--target", t, "generate", "--prompt-ids", "5,49152")
    assert code == 1 and "INVALID_ARGUMENT" in err and "vocabulary" in err


def test_client_cli_constrains_and_calls_tools(served, capsys, tmp_path):
    """generate --json-schema @FILE and --tools / --tool-choice: the answers the library's
    build_request arguments give, which validate (the tiny model's random weights write JSON
    only under the grammar)."""
    t = served.target
    schema = dict(SCHEMA, **COMPACT)
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, err = run_cli(capsys, "client", "--target", t, "generate", "--prompt-ids", ",".join(map(str, IDS_A)),
                             "--json-schema", f"@{tmp_path / 'schema.json'}", "--max-tokens", "40")
    want = served.client.generate(IDS_A, structured={"json_schema": schema}, max_tokens=40)
    assert code == 0 and out.rstrip("\n") == want.text and "stop" in err
    jsonschema.validate(json.loads(out), SCHEMA)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    code, out, err = run_cli(capsys, "client", "--target", t, "generate", "Weather in Paris?", "--tools",
                             f"@{tmp_path / 'tools.json'}", "--tool-choice", "get_weather", "--no-parallel-tool-calls",
                             "--max-tokens", "60", "--request-id", "cli-tools")
    want = served.client.generate([{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                  tool_choice={"name": "get_weather"}, parallel_tool_calls=False, max_tokens=60,
                                  request_id="cli-tools")
    assert code == 0 and "tool_calls" in err, err
    call = json.loads(out.strip().splitlines()[-1])
    assert (call["id"], call["name"], call["arguments"]) == (want.tool_calls[0].id, "get_weather",
                                                             want.tool_calls[0].arguments)
    jsonschema.validate(json.loads(call["arguments"]), UNIT)


def test_build_request_takes_the_agent_fields_in_openai_and_proto_shapes():
    from jaxserve.client import build_request
    from jaxserve.v1 import jaxserve_pb2 as pb

    schema = {"type": "object"}
    a = build_request("x", structured={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert a.structured == build_request("x", structured={"json_schema": json.dumps(schema)}).structured
    assert json.loads(a.structured.json_schema) == schema
    assert build_request("x", structured={"type": "json_object"}).structured.json_object
    assert build_request("x", structured={"regex": "[0-9]+"}).structured.regex == "[0-9]+"
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "name": "w", "content": "20"}]
    r = build_request(history, tools=[{"name": "w", "parameters": schema}], parse_output=True,
                      tool_choice={"type": "function", "function": {"name": "w"}}, parallel_tool_calls=False,
                      chat_template_kwargs={"enable_thinking": False})
    assert list(r.tools) == [pb.Tool(name="w", parameters=json.dumps(schema))]
    assert r.tool_choice.function == "w" and r.parallel_tool_calls is False and r.parse_output
    assert r.messages[1].tool_calls[0] == pb.ToolCall(id="c1", name="w", arguments='{"unit": "c"}')
    assert (r.messages[2].role, r.messages[2].tool_call_id, r.messages[2].name) == ("tool", "c1", "w")
    assert json.loads(r.chat_template_kwargs) == {"enable_thinking": False}
    assert build_request(history[:1], tool_choice="required").tool_choice.required
    assert not build_request("x").HasField("structured") and not build_request("x").HasField("tool_choice")
    for bad in (dict(structured={"yaml": "x"}), dict(tool_choice="sometimes"), dict(tools=[{"description": "x"}])):
        with pytest.raises(ValueError):
            build_request(history[:1], **bad)


def test_streamed_deltas_print_text_and_ids_only_without_text():
    from jaxserve.server.client_cli import delta_output
    from jaxserve.v1 import jaxserve_pb2 as pb

    assert delta_output(pb.TokenDelta(token_ids=[2], text=""), text_prompt=True) == ""  # EOS after a text
    assert delta_output(pb.TokenDelta(token_ids=[9], text=" Paris"), text_prompt=True) == " Paris"
    assert delta_output(pb.TokenDelta(token_ids=[5, 6], text=""), text_prompt=False) == "5 6 "  # no tokenizer


@pytest.mark.slow
def test_serve_subprocess_warms_up_then_drains_on_sigterm(tiny_text_model):
    from jaxserve.client import Client

    proc = subprocess.Popen(serve_args(tiny_text_model, "--http-port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=server_env())
    lines = []
    try:
        target = http = None
        for line in proc.stdout:  # "listening on H:P ..." comes first, then "SERVING on H:P ..."
            lines.append(line)
            if "HTTP API on" in line:
                http = line.split(" on ")[1].split()[0]
            if "SERVING on" in line:
                target = line.split("SERVING on ")[1].split()[0]
                break
        assert target, "".join(lines)
        with Client(target, timeout=60) as client:
            assert client.health() == "SERVING"
            # Three 240-token streams keep the server busy for hundreds of steps after SIGTERM.
            streams = [client.generate_stream([5, 6, 7 + i], max_tokens=240, ignore_eos=True) for i in range(3)]
            for it in streams:
                assert next(it).WhichOneof("event") == "start"
            proc.send_signal(signal.SIGTERM)  # drain: health NOT_SERVING, new work refused...
            end = time.monotonic() + 10
            while client.health() != "NOT_SERVING" and time.monotonic() < end:
                time.sleep(0.01)
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                client.generate([5, 6], max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
            status, body, headers = http_call(http + "/completions", {"model": Path(tiny_text_model).name,
                                                                      "prompt": [5, 6], "max_tokens": 2})
            assert status == 503 and "draining" in body["error"]["message"] and "retry-after" in headers
            for it in streams:  # ...and the running streams still finish
                events = list(it)
                assert events[-1].WhichOneof("event") == "end" and events[-1].end.usage.completion_tokens == 240
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout))
        rest.start()
        assert proc.wait(60) == 0, "".join(lines)
        rest.join(5)
        assert any("draining" in x for x in lines) and any("stopped" in x for x in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_module_does_not_import_jax():
    # Clients (and `jaxserve client`) must start instantly and install nothing heavy.
    code = "import sys, jaxserve.client, jaxserve.server.cli; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
