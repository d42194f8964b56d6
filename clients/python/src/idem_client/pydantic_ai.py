"""Pydantic AI: a tool whose every call goes through idem; a key waiting for approval becomes
Pydantic AI's deferred approval (``ApprovalRequired``).

    from idem_client.pydantic_ai import idem_tool

    refund = idem_tool(idem, "refund", RefundArgs, run_id=lambda ctx: ctx.deps.run_id,
                       business_id=lambda ctx, a: a.order_id)
    agent = Agent(model, tools=[refund])

When idem parks the call ``pending_approval``, the run ends with ``DeferredToolRequests``.
Decide in idem (``idem approve``), then continue the run with the call approved
(``DeferredToolResults``): the tool waits for idem's decision and returns its outcome.
"""

from __future__ import annotations

from typing import Any, Callable, Type, TypeVar

from pydantic import BaseModel
from pydantic_ai import ApprovalRequired, RunContext, Tool

from ._answer import call, for_model
from ._client import Idem

P = TypeVar("P", bound=BaseModel)


def idem_tool(
    idem: Idem,
    tool: str,
    params_model: Type[P],
    *,
    run_id: Callable[[RunContext[Any]], str],
    business_id: "str | Callable[[RunContext[Any], P], str | None] | None" = None,
    name: str | None = None,
    description: str | None = None,
    timeout: float = 30.0,
) -> Tool[Any]:
    """A Pydantic AI ``Tool`` taking one argument, ``args`` (``params_model``)."""

    async def run(ctx: RunContext[Any], args: Any) -> str:
        business = business_id(ctx, args) if callable(business_id) else business_id
        outcome = await call(
            idem, tool, args.model_dump(mode="json"), run_id=run_id(ctx), business_id=business, timeout=timeout
        )
        if isinstance(outcome, str):
            return outcome
        if outcome.status == "pending_approval":
            if not ctx.tool_call_approved:
                raise ApprovalRequired(metadata={"idempotency_key": outcome.idempotency_key})
            # Approved in the run: idem's own decision is what runs it; wait for it.
            outcome = await idem.await_settled(outcome, timeout=timeout, raise_on_status=False)
        return for_model(outcome)

    # The schema the model sees is the params model's (annotations here are strings until read).
    run.__annotations__ = {"ctx": RunContext[Any], "args": params_model, "return": str}
    return Tool(
        run,
        takes_ctx=True,
        name=name or tool,
        description=description or params_model.__doc__ or f"Runs {tool} once, through idem.",
    )
