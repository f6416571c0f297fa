"""Agents' tool loops as the turn pipeline sees them: one turn, however many steps.

A tool loop is a user message, then steps: the model answers with ``tool_calls``, the client
runs the tools and sends their results back (``tool`` messages) for the next step, until the
model gives its final answer. The pipeline treats the whole loop as one turn:

- each step recalls for the loop's user message (the last ``user`` message, before the
  calls and their results), so every step sees the same memories;
- a step's reply that calls tools is not an answer yet: it is not written back, so no later
  step (nor any later turn) is given the loop's own half-done steps as memories;
- the reply that ends the loop is written back once, as ``User: <the user's message>`` and
  ``Assistant: <the final answer>``. Tool results are never stored: they hold what the tools
  said, not what the user said.

Structured output through a forced tool (``tool_choice`` names a function) is a loop of one
step whose call *is* the answer: its reply is written back with the call's arguments (the
structured result the client reads) as the assistant side. A client that goes on after such a
call, sending its result back, makes a loop whose final answer is stored too.
"""

from __future__ import annotations

from typing import Any

from gateway_http.messages import message_text


def calls_of(message: Any) -> list[dict[str, Any]]:
    """The function calls an assistant message makes: its ``tool_calls`` (function ones),
    or the older API's ``function_call``; each ``{"name", "arguments"}``."""
    if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
        return []
    calls: list[dict[str, Any]] = []
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                calls.append(function)
            elif isinstance(call, dict):
                # A custom tool's call: it has no function, but it is a call all the same.
                calls.append({})
    function_call = message.get("function_call")
    if isinstance(function_call, dict):
        calls.append(function_call)
    return calls


def forced_function(body: dict[str, Any]) -> str | None:
    """The function a request forces the model to call (``tool_choice`` naming it, or the
    older ``function_call: {"name": …}``), or None."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    legacy = body.get("function_call")
    if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
        return str(legacy["name"])
    return None


def stored_answer(body: dict[str, Any], reply: dict[str, Any]) -> str | None:
    """The assistant side to write back for ``reply`` to the request ``body``, or None when
    the reply is a step of a tool loop (it calls tools the client is to run: the loop's last
    reply is the one stored).

    A reply without calls is stored by its text. A reply whose calls the request forced
    (``tool_choice`` names the function) is the turn's answer: its calls' arguments, as
    sent, one per line.
    """
    calls = calls_of(reply)
    if not calls:
        return message_text(reply)
    forced = forced_function(body)
    if forced is None:
        return None
    arguments = [
        call["arguments"]
        for call in calls
        if call.get("name") == forced and isinstance(call.get("arguments"), str)
    ]
    return "\n".join(arguments) if arguments else None
