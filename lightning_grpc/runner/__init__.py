"""Run agents on rollouts from the Store."""

from .agent import FunctionAgent, Hook, LitAgent, rollout, routed_resources
from .fleet import RayFleet, RayPlacement, RunnerSpec, load_agent, run_processes
from .llm import openai_client
from .runner import RolloutOutcome, Runner, default_worker_id, run_forever
from .stats import system_snapshot

__all__ = [
    "FunctionAgent",
    "Hook",
    "LitAgent",
    "RayFleet",
    "RayPlacement",
    "RolloutOutcome",
    "Runner",
    "RunnerSpec",
    "default_worker_id",
    "load_agent",
    "openai_client",
    "rollout",
    "routed_resources",
    "run_forever",
    "run_processes",
    "system_snapshot",
]
