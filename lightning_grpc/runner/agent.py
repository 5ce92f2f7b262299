"""Agents: a ``@rollout`` function or a ``LitAgent`` subclass, and the hooks a runner calls.

An agent receives the task input and the resources it names, and returns a float reward,
nothing (rewards emitted inside with :func:`lightning_grpc.tracing.emit_reward`), or raises
(the attempt fails with the error).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from lightning_grpc.types import LLM, PromptTemplate, ProxyLLM, Resource, Rollout

#: What an agent may return.
RolloutResult = float | int | Mapping[str, float] | None


class LitAgent:
    """Base class for agents with state: override ``rollout`` (sync or async) and optionally the hooks.

    ``setup`` runs once in each runner process before the first rollout, ``teardown`` when it stops.
    ``training_rollout`` / ``validation_rollout`` default to ``rollout``; the runner picks by the
    rollout's mode (train -> training_rollout, otherwise validation_rollout).
    """

    def setup(self) -> Any:
        return None

    def teardown(self) -> Any:
        return None

    def rollout(self, task: Any, resources: Mapping[str, Resource], rollout: Rollout) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout(task, resources, rollout)")

    def training_rollout(self, task: Any, resources: Mapping[str, Resource], rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: Any, resources: Mapping[str, Resource], rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)


class Hook:
    """Runner hooks; every method may be sync or async. Exceptions in hooks are logged, never fatal."""

    def on_rollout_start(self, rollout: Rollout) -> Any:
        return None

    def on_rollout_end(self, rollout: Rollout, result: Any, error: BaseException | None) -> Any:
        return None

    def on_trace_start(self, rollout: Rollout) -> Any:
        return None

    def on_trace_end(self, rollout: Rollout) -> Any:
        return None


class FunctionAgent(LitAgent):
    """An agent made from a function by :func:`rollout`; arguments are injected by name and type."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__name__ = getattr(fn, "__name__", "agent")
        self.__doc__ = fn.__doc__

    def bind(
        self, task: Any, resources: Mapping[str, Resource], rollout: Rollout
    ) -> tuple[list[Any], dict[str, Any]]:
        params = list(self.signature.parameters.values())
        if not params:
            raise TypeError(f"agent {self.__name__} must take the task input as its first parameter")
        args: list[Any] = [task]
        kwargs: dict[str, Any] = {}
        for p in params[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            value = _injected(p, resources, rollout)
            if value is _MISSING:
                if p.default is p.empty:
                    raise LookupError(
                        f"agent {self.__name__} needs {p.name!r} but the rollout's resources have "
                        f"{sorted(resources) or 'none'}"
                    )
                continue
            kwargs[p.name] = value
        return args, kwargs

    def rollout(self, task: Any, resources: Mapping[str, Resource], rollout: Rollout) -> Any:
        args, kwargs = self.bind(task, resources, rollout)
        return self.fn(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_MISSING = object()


def _injected(p: inspect.Parameter, resources: Mapping[str, Resource], rollout: Rollout) -> Any:
    if p.name == "rollout" or p.annotation is Rollout or p.annotation == "Rollout":
        return rollout
    if p.name == "resources":
        return resources
    if p.name in resources:
        return resources[p.name]
    annotation = p.annotation if isinstance(p.annotation, type) else None
    wanted: tuple[type, ...] | None = None
    if p.name == "llm" or annotation in (LLM, ProxyLLM) or p.annotation in ("LLM", "ProxyLLM"):
        wanted = (LLM, ProxyLLM)
    elif p.name == "prompt_template" or annotation is PromptTemplate or p.annotation == "PromptTemplate":
        wanted = (PromptTemplate,)
    if wanted is not None:
        matches = {name: r for name, r in resources.items() if isinstance(r, wanted)}
        if len(matches) == 1:
            return next(iter(matches.values()))
        preferred = f"main_{p.name}"
        if preferred in matches:
            return matches[preferred]
        if len(matches) > 1:
            raise LookupError(
                f"parameter {p.name!r} is ambiguous: the resources hold several ({', '.join(sorted(matches))}); "
                f"name the parameter after one of them, or call one {preferred!r}"
            )
    return _MISSING


def rollout(fn: Callable[..., Any]) -> FunctionAgent:
    """Make an agent from a function (sync or async).

    The first parameter receives the task input. Other parameters are filled by name from the
    rollout's resources (``def agent(task, main_llm, system_prompt)``), or by kind: ``llm`` (the
    LLM endpoint, already routed to the attempt when it is a proxy endpoint; with several, the one
    named ``main_llm``), ``prompt_template`` (likewise ``main_prompt_template``), ``resources``
    (all of them) and ``rollout`` (the Rollout being run).
    """
    return FunctionAgent(fn)


def routed_resources(resources: Mapping[str, Resource], rollout: Rollout) -> dict[str, Resource]:
    """Resources as one attempt sees them: proxy endpoints become the attempt's own LLM endpoint, with
    the attempt's credential (when the Store issued one) as its API key."""
    attempt = rollout.latest_attempt
    out: dict[str, Resource] = {}
    for name, resource in resources.items():
        if isinstance(resource, ProxyLLM) and attempt is not None:
            routed = resource.for_attempt(rollout.rollout_id, attempt.attempt_id)
            if attempt.credential:
                routed.api_key = attempt.credential
            out[name] = routed
        else:
            out[name] = resource
    return out
