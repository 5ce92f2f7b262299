"""The prompt-search agent, for a runner fleet started from the command line.

    lightning-grpc runner examples.prompt_search.agent:agent --store 127.0.0.1:4747 --concurrency 8

For each rollout it renders the rollout's prompt template (the ``PromptTemplate`` resource of the
candidate being tried, injected by kind into the ``prompt_template`` parameter) with the task,
scores the prompt, and returns the score; the runner records it as the rollout's reward. In short:

    @operation(name="score")                 # the trace of each rollout shows this call
    def score(prompt: str, task) -> float:   # deterministic stand-in for an LLM call and its grading
        ...

    @rollout
    def agent(task, prompt_template: PromptTemplate) -> float:
        return score(prompt_template.format(**task), task)

Both are defined once, in :mod:`lightning_grpc.examples.prompt_search_demo`: ``make demo`` runs
them from an installed package, where this folder does not exist. This module names them here.
"""

from lightning_grpc.examples.prompt_search_demo import agent, score

__all__ = ["agent", "score"]
