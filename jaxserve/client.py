"""Python clients for a ``jaxserve serve`` server (gRPC, ``jaxserve.v1.JaxServe``).

    from jaxserve.client import Client
    with Client("127.0.0.1:50051") as c:
        r = c.generate("What is the capital of France?", max_tokens=32, chat_template=True)
        r.text, list(r.token_ids), r.finish_reason, r.usage.cached_tokens
        for ev in c.generate_stream([1, 4093, 198], max_tokens=8):
            ...  # ev.start, then ev.delta (token_ids, text), then ev.end (finish reason, usage, timing)
        chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
        r = c.generate(chat, max_tokens=16, logprobs=3, n=2)  # a conversation; log-probs; 2 choices
        r.logprobs[0].logprob, r.logprobs[0].top, [ch.text for ch in r.choices]
        r = c.generate([{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool],
                       tool_choice="required")  # r.tool_calls[0].name, .arguments (JSON text)
        r = c.generate("A colour as JSON:", structured={"json_schema": schema}, max_tokens=32)

``AsyncClient`` has the same methods as coroutines (``generate_stream`` returns an async
iterator with ``.cancel()``). Errors are ``grpc.RpcError`` with the server's status code;
``retry_after_s(err)`` reads the retry hint sent with RESOURCE_EXHAUSTED / UNAVAILABLE;
``Client(target, retries=3)`` lets gRPC itself retry those, waiting what the server asks
(``grpc-retry-pushback-ms``).
Sampling arguments left as None are not sent, so the server's defaults apply.

A server started with ``--api-key`` / ``--tls-*`` needs the matching options:
``Client(target, api_key="...", root_certificates=ca_pem)`` (``tls=True`` alone uses the
system roots; ``private_key`` + ``certificate_chain`` present a client certificate for mTLS).
The key travels as ``authorization: Bearer <key>`` on every call the client's methods make
(calls made on ``client.stub`` directly pass ``client.call_metadata()`` themselves).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import client_agents
from jaxserve.server.errors import retry_after_s
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

__all__ = ["Client", "AsyncClient", "build_request", "retry_after_s", "pb"]

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "logprobs")
FINISH_REASON_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                       pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
                       pb.FINISH_REASON_UNSPECIFIED: "unspecified"}


def build_request(prompt: str | Sequence[int] | Sequence[dict], *, max_tokens: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool | None = None,
                  request_id: str = "", session_id: str = "", chat_template: bool = False, n: int | None = None,
                  structured=None, tools=None, tool_choice=None, parallel_tool_calls: bool | None = None,
                  parse_output: bool | None = None, chat_template_kwargs: dict | None = None,
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest: a text prompt, token ids or a conversation ([{"role", "content"}],
    rendered with the model's chat template; tool calls and results as OpenAI writes them),
    sampling keyword arguments (temperature, top_p, top_k, min_p, seed, repetition_penalty,
    presence_penalty, frequency_penalty, logprobs), stop criteria and n (completions); None
    means unset (the server default). Agent fields (``jaxserve.client_agents`` gives their
    shapes): ``structured`` (a JSON schema, any JSON object, a regex or a Lark grammar; also
    OpenAI's response_format), and for conversations ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``parse_output`` and ``chat_template_kwargs``."""
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; known: {list(_SAMPLING)}")
    req = pb.GenerateRequest(request_id=request_id, session_id=session_id, apply_chat_template=chat_template,
                             n=n or 0)
    if isinstance(prompt, str):
        req.text = prompt
    elif len(prompt) and all(isinstance(m, dict) for m in prompt):
        req.messages.extend(client_agents.chat_message(m) for m in prompt)
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
        req.token_ids.SetInParent()  # an empty id list is still "token ids" (the server says: empty prompt)
    for name, value in sampling.items():
        if value is not None:
            setattr(req.sampling, name, value)
    if max_tokens is not None:
        req.stop.max_tokens = max_tokens
    if ignore_eos is not None:
        req.stop.ignore_eos = ignore_eos
    req.stop.stop.extend([stop] if isinstance(stop, str) else stop)
    req.stop.stop_token_ids.extend(stop_token_ids)
    client_agents.set_agent_fields(req, structured, tools, tool_choice, parallel_tool_calls, parse_output,
                                   chat_template_kwargs)
    return req


def finish_reason(msg) -> str:
    """"stop" | "length" | "abort" | "tool_calls" of a GenerateResponse or StreamEnd."""
    return FINISH_REASON_NAMES[msg.finish_reason]


def _credentials(tls: bool, root_certificates: bytes | None, private_key: bytes | None,
                 certificate_chain: bytes | None):
    """grpc.ChannelCredentials, or None for plaintext."""
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("a client certificate needs both private_key and certificate_chain")
    if not (tls or root_certificates or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def retry_service_config(retries: int) -> str:
    """A gRPC service config retrying every JaxServe call up to ``retries`` more times on
    RESOURCE_EXHAUSTED (queue full) and UNAVAILABLE (warming up, draining): gRPC waits the
    server's ``grpc-retry-pushback-ms`` when it sends one, else backs off exponentially."""
    policy = {"maxAttempts": min(retries + 1, 5), "initialBackoff": "0.1s", "maxBackoff": "10s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]}
    return json.dumps({"methodConfig": [{"name": [{"service": "jaxserve.v1.JaxServe"}], "retryPolicy": policy}]})


class _Base:
    def __init__(self, target, timeout, api_key, aio: bool, channel, retries: int = 0, **tls):
        self.target = target
        self.timeout = timeout
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if channel is None:
            creds = _credentials(**tls)
            mod = grpc.aio if aio else grpc
            opts = [("grpc.enable_retries", 1), ("grpc.service_config", retry_service_config(retries))] \
                if retries else []
            channel = (mod.insecure_channel(target, options=opts) if creds is None
                       else mod.secure_channel(target, creds, options=opts))
        self.channel = channel
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def call_metadata(self, metadata=None, session_header: str | None = None):
        """Metadata for a call: the API key (if any), `metadata`, the session header."""
        md = [*self._auth, *(metadata or ())]
        if session_header:
            md.append(("x-session-affinity", session_header))
        return tuple(md) or None


class Client(_Base):
    """A blocking client. target: "host:port"; timeout: default deadline per call (seconds);
    api_key / tls / root_certificates / private_key / certificate_chain: see the module doc."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, channel=None, *,
                 api_key: str | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None, retries: int = 0):
        super().__init__(target, timeout, api_key, False, channel, retries, tls=tls,
                         root_certificates=root_certificates, private_key=private_key,
                         certificate_chain=certificate_chain)

    def generate(self, prompt, *, timeout: float | None = None, metadata=None, session_header: str | None = None,
                 **kwargs) -> pb.GenerateResponse:
        """Generate and wait: a GenerateResponse (token_ids, text, finish_reason, usage, timing)."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self._t(timeout),
                                  metadata=self.call_metadata(metadata, session_header))

    def generate_stream(self, prompt, *, timeout: float | None = None, metadata=None,
                        session_header: str | None = None, **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Stream events: one `start`, `delta`s, one `end`. The returned call is an iterator
        with .cancel(): cancelling aborts the request on the server and frees its pages."""
        return self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=self._t(timeout),
                                        metadata=self.call_metadata(metadata, session_header))

    def tokenize(self, text: str, *, add_special_tokens: bool | None = None, chat_template: bool = False,
                 timeout: float | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text, apply_chat_template=chat_template)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return list(self.stub.Tokenize(req, timeout=self._t(timeout), metadata=self.call_metadata()).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids))
        if skip_special_tokens is not None:
            req.skip_special_tokens = skip_special_tokens
        return self.stub.Detokenize(req, timeout=self._t(timeout), metadata=self.call_metadata()).text

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout),
                                      metadata=self.call_metadata())

    def abort(self, *request_ids: str, timeout: float | None = None) -> pb.AbortResponse:
        return self.stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=self._t(timeout),
                               metadata=self.call_metadata())

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """"SERVING" | "NOT_SERVING" | ... (grpc.health.v1); service "" = the whole server."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout) or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 300.0, poll: float = 0.1) -> None:
        """Block until health is SERVING (warm-up done); raises TimeoutError."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=max(poll, 1.0)) == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > end:
                raise TimeoutError(f"{self.target} not SERVING after {timeout}s")
            time.sleep(poll)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    """The grpc.aio twin of Client (create it inside a running event loop)."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, channel=None, *,
                 api_key: str | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None, retries: int = 0):
        super().__init__(target, timeout, api_key, True, channel, retries, tls=tls,
                         root_certificates=root_certificates, private_key=private_key,
                         certificate_chain=certificate_chain)

    async def generate(self, prompt, *, timeout=None, metadata=None, session_header=None, **kwargs):
        return await self.stub.Generate(build_request(prompt, **kwargs), timeout=self._t(timeout),
                                        metadata=self.call_metadata(metadata, session_header))

    def generate_stream(self, prompt, *, timeout=None, metadata=None, session_header=None, **kwargs):
        """An async iterator of GenerateStreamResponse with .cancel()."""
        return self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=self._t(timeout),
                                        metadata=self.call_metadata(metadata, session_header))

    async def tokenize(self, text: str, *, add_special_tokens: bool | None = None, chat_template: bool = False,
                       timeout: float | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text, apply_chat_template=chat_template)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        resp = await self.stub.Tokenize(req, timeout=self._t(timeout), metadata=self.call_metadata())
        return list(resp.token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = None) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids))
        if skip_special_tokens is not None:
            req.skip_special_tokens = skip_special_tokens
        return (await self.stub.Detokenize(req, timeout=self._t(timeout), metadata=self.call_metadata())).text

    async def model_info(self, timeout=None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout),
                                            metadata=self.call_metadata())

    async def abort(self, *request_ids: str, timeout=None) -> pb.AbortResponse:
        return await self.stub.Abort(pb.AbortRequest(request_ids=list(request_ids)), timeout=self._t(timeout),
                                     metadata=self.call_metadata())

    async def health(self, service: str = "", timeout=None) -> str:
        resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._t(timeout) or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 300.0, poll: float = 0.1) -> None:
        """Wait until health is SERVING (warm-up done); raises TimeoutError."""
        end = time.monotonic() + timeout
        while True:
            try:
                if await self.health(timeout=max(poll, 1.0)) == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > end:
                raise TimeoutError(f"{self.target} not SERVING after {timeout}s")
            await asyncio.sleep(poll)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
