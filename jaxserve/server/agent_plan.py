"""The agent plan of a chat request, the same for every front (the OpenAI HTTP API and gRPC):
``AgentRequest`` (what a request asks for: response format, tools, tool choice, template
kwargs; each front parses its own wire shape into it), the cross-field rules it must obey
(``check_tools``, ``check_choice``), the history's tool messages (``check_messages``), and
``AgentFront`` (one per server: the checkpoint's tool-call and reasoning parsers) that renders
the prompt with the tools and plans each request: the grammar it runs under (the response
format, or a tool call in the model's own format when a tool is required or named), whether
special tokens stay in the text, and the parser that turns the text into content, reasoning and
tool calls. Errors are INVALID_ARGUMENT naming the field (OpenAI's names; gRPC's are the same).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from jaxserve.agents import tool_parsers
from jaxserve.agents.message import MessageParser
from jaxserve.agents.reasoning import CLOSE as THINK_CLOSE, OPEN as THINK_OPEN, ThinkParser
from jaxserve.agents.tool_grammar import marker_token, tool_call_grammar
from jaxserve.server import errors
from jaxserve.structured.spec import StructuredOutput


@dataclasses.dataclass
class AgentRequest:
    structured: StructuredOutput | None = None  # the response format (the answer's grammar)
    tools: list = dataclasses.field(default_factory=list)
    tool_choice: object = "auto"  # "none" | "auto" | "required" | the named function's name (str in a dict)
    parallel: bool = True
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    field: str | None = None  # the body field the response format came from (for error reports)

    @property
    def named(self) -> str | None:
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None


def check_tools(tools: list[dict]) -> list[dict]:
    """Tools as {type: function, function: {name, ...}}: function names unique."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise errors.invalid_argument("tools: function names must be unique", "tools")
    return tools


def check_choice(choice, tools: list[dict], structured) -> object:
    """``choice``: "none" | "auto" | "required" | {"name": str} (a front's parse of its own
    shape); a named function must be in ``tools``, required needs tools, and neither combines
    with a response format."""
    if isinstance(choice, dict):
        if not isinstance(choice.get("name"), str) or choice["name"] not in {t["function"]["name"] for t in tools}:
            raise errors.invalid_argument("tool_choice names a function that is not in tools", "tool_choice")
    elif choice == "required" and not tools:
        raise errors.invalid_argument("tool_choice required needs tools", "tool_choice")
    if (choice == "required" or isinstance(choice, dict)) and structured is not None:
        raise errors.invalid_argument("a required or named tool choice and a response format cannot both "
                                      "constrain the output", "tool_choice")
    return choice


def check_template_kwargs(kwargs) -> dict:
    if not isinstance(kwargs, dict) or any(k in ("messages", "tools", "add_generation_prompt") for k in kwargs):
        raise errors.invalid_argument("chat_template_kwargs must be an object (not messages, tools or "
                                      "add_generation_prompt)", "chat_template_kwargs")
    return kwargs


TOOLS_PROMPT = ("You can call functions. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
                "To call one, answer with <tool_call>\n{{\"name\": <name>, \"arguments\": <arguments as a JSON "
                "object>}}\n</tool_call> for each call.")


def describe_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a chat template without tool support: the tools in the system message (Hermes-style),
    earlier assistant calls as their <tool_call> text, and tool results as user turns' text."""
    desc = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
    out = [dict(m) for m in messages]
    for m in out:
        for c in m.pop("tool_calls", None) or ():
            call = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            m["content"] += f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + desc
    else:
        out.insert(0, {"role": "system", "content": desc})
    return out


@dataclasses.dataclass
class Plan:
    """How one request runs and reads: its grammar, special tokens kept, its message parser."""

    structured: StructuredOutput | None
    skip_special_tokens: bool
    parser: MessageParser | None  # None: plain text (completions, or nothing to parse)

    def sampling(self) -> dict:
        out = {"skip_special_tokens": self.skip_special_tokens}
        if self.structured is not None:
            out["structured"] = self.structured
        return out


class AgentFront:
    """Per server: the tokenizer and the checkpoint's parsers (chosen, or named by flags)."""

    def __init__(self, tokenizer, architecture: str = "", model_type: str = "", tool_parser: str | None = None,
                 reasoning_parser: str | None = None):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.tool_parser = tool_parser or tool_parsers.choose(architecture, model_type, template)
        tool_parsers.make(self.tool_parser)  # an unknown name fails at start
        self.reasoning = reasoning_parser or tool_parsers.choose_reasoning(template)
        if self.reasoning not in tool_parsers.REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning!r}; choose one of "
                             f"{', '.join(tool_parsers.REASONING_PARSERS)}")

    def render(self, messages: list[dict], agent: AgentRequest) -> str:
        """The chat prompt's text: the template with the tools (unless tool_choice none) and kwargs."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise errors.failed_precondition("this model has no chat template")
        kw = dict(agent.template_kwargs)
        if agent.tools and agent.tool_choice != "none":
            if "tools" in self.tokenizer.chat_template:
                kw["tools"] = agent.tools
            else:  # a template that knows no tools: described in the system turn, calls written as text
                messages = describe_tools(messages, agent.tools)
        try:
            return self.tokenizer.apply_chat_template(messages, **kw)
        except Exception as e:  # the template may raise (e.g. roles out of order)
            raise errors.invalid_argument(f"the chat template rejected the messages: {e}") from e

    def thinking(self, prompt: str, agent: AgentRequest) -> ThinkParser | None:
        if self.reasoning == "none" or agent.template_kwargs.get("enable_thinking") is False:
            return None
        tail = prompt.rstrip()
        if tail.endswith(THINK_CLOSE):
            return None  # the template closed the thinking (thinking off)
        return ThinkParser(opened_in_prompt=tail.endswith(THINK_OPEN))

    def plan(self, chat: bool, agent: AgentRequest, prompt: str) -> Plan:
        if not chat:
            return Plan(agent.structured, True, None)
        think = self.thinking(prompt, agent)
        tools = agent.tools if agent.tool_choice != "none" else []
        parser = tool_parsers.make(self.tool_parser, tools) if tools else None
        spec = agent.structured
        if tools and (agent.tool_choice == "required" or agent.named):
            chosen = [t for t in tools if t["function"]["name"] == agent.named] if agent.named else tools
            grammar = tool_call_grammar(self.tool_parser, chosen, agent.parallel and not agent.named,
                                        marker_token(self.tokenizer))
            spec = StructuredOutput("grammar", grammar)
        if spec is not None and think is not None:
            spec = dataclasses.replace(spec, after=THINK_CLOSE)  # the answer after the thinking
        special = parser is not None and getattr(parser, "special_markers", False)
        return Plan(spec, not (special or think is not None),
                    MessageParser(parser, think) if (parser is not None or think is not None) else None)


def arguments_ok(arguments: str) -> bool:
    """A tool call's arguments are a JSON object."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


async def check_grammar(check, agent: AgentRequest, spec: StructuredOutput) -> None:
    """INVALID_ARGUMENT naming the field when ``spec`` cannot compile (``await check(spec)``:
    ``ServingCore.check_structured``, compiled off the loop)."""
    try:
        await check(spec)
    except ValueError as e:
        param = agent.field if spec.kind != "grammar" or agent.structured is not None else "tools"
        raise errors.invalid_argument(str(e), param) from None


def count_calls(metrics, parser: str, calls) -> None:
    """``metrics``: the server's AgentMetrics."""
    for c in calls:
        metrics.tool_calls.labels(parser).inc()
        if not arguments_ok(c.arguments):
            metrics.tool_calls_invalid.labels(parser).inc()


def call_ids(request_id: str, choice: int):
    """Tool-call ids the stream and the whole response share: a hash of request, choice, index."""
    def call_id(i: int) -> str:
        return "call_" + hashlib.sha256(f"{request_id}:{choice}:{i}".encode()).hexdigest()[:24]
    return call_id


def check_messages(messages, check) -> list[dict]:
    """Chat messages: {role, content} as ``check`` (the plain messages' validator) takes them, plus a tool's
    result (role "tool", tool_call_id) and an assistant's tool_calls (content may be empty;
    each call's JSON arguments become a dict, as chat templates read them)."""
    plain, extra = [], {}
    for i, m in enumerate(messages or []):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise errors.invalid_argument(f"messages[{i}].tool_calls: only an assistant's, as a list")
            extra[i] = {"tool_calls": [_history_call(c, i) for c in calls]}
            if m.get("content") is None:
                m["content"] = ""
        if m.get("role") == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise errors.invalid_argument(f"messages[{i}].tool_call_id must be a string")
            extra.setdefault(i, {}).update({k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None})
        plain.append(m)
    out = check(plain)
    return [dict(m, **extra.get(i, {})) for i, m in enumerate(out)]


def _history_call(c, i: int) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise errors.invalid_argument(f"messages[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise errors.invalid_argument(f"messages[{i}].tool_calls: arguments are not JSON") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
