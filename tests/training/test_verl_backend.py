"""The verl backend's seams, on CPU, in an environment with verl 0.9.1 (`make verl-test`; skipped elsewhere).

What runs here: the experiment translated into verl's trainer config and checked by verl's own config
classes; batches from a real TrainerService turned into verl's DataProto and put through verl's own
``compute_advantage`` and ``ppo_loss``, equal to our loop's figures; and the rollout side of the seam
against the real Store, proxy and embedded engine standing in for a vLLM replica (registered the way
verl's replica addresses are), giving exactly the ids the engine sampled. What cannot run without
GPUs: verl's FSDP workers, vLLM and Ray placement (docs/verl.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import pytest_asyncio
import torch
from torch.testing import assert_close

pytest.importorskip(
    "verl.trainer.ppo.ray_trainer",
    reason="verl 0.9.1 is not installed here; `make verl-test` runs these tests in .venv-verl",
)

from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.proxy import LLMProxy, ProxyConfig
from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.training import ppo
from lightning_grpc.training.experiment import ConfigError, load_experiment
from lightning_grpc.training.learner import rollout_rewards_and_groups
from lightning_grpc.training.verl_backend import (
    data_proto,
    replica_backends,
    trainer_class,
    verl_config,
)
from tests.batching.test_trainer_service import Play, run_rollouts
from tests.e2e.test_trainer_e2e import chat_ids, digit_bias, two_turns
from tests.engine_fixtures import MODEL, Engine, loopback_guard
from tests.helpers import reward_span, serving

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "combination_lock" / "config.toml"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    yield from loopback_guard(monkeypatch)


# ================================================================= the config
def test_the_demo_experiment_becomes_a_config_verls_classes_accept() -> None:
    config = load_experiment(DEMO)
    cfg = verl_config(config)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert type(actor).__name__ == "FSDPActorConfig" and isinstance(actor, ActorConfig)
    assert actor.optim.lr == config.optim.lr == 2e-3
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert actor.loss_agg_mode == "token-mean" and actor.ppo_epochs == 1
    assert actor.ppo_mini_batch_size * rollout.n == 16 * 16  # one mini-batch: the whole step
    assert algorithm.adv_estimator == "grpo" and algorithm.norm_adv_by_std_in_grpo is True
    assert rollout.n == 16 and rollout.temperature == 1.0 and rollout.name == "vllm"
    assert cfg.data.train_batch_size == 16 and cfg.trainer.total_training_steps == 200
    assert Path(cfg.actor_rollout_ref.model.path) == config.path(config.model.path).resolve()
    # the demo's dynamic sampling, as verl's algorithm.filter_groups
    assert algorithm.filter_groups.enable is True and algorithm.filter_groups.max_num_gen_batches == 4


def test_dynamic_sampling_becomes_verls_filter_groups() -> None:
    config = load_experiment(DEMO, {"data.filter_groups": True, "data.max_num_gen_batches": 3})
    algorithm = omega_conf_to_dataclass(verl_config(config).algorithm)
    assert type(algorithm.filter_groups).__name__ == "FilterGroupsConfig"
    assert algorithm.filter_groups.enable is True and algorithm.filter_groups.max_num_gen_batches == 3
    assert algorithm.filter_groups.metric == "seq_final_reward"


def test_what_verl_cannot_run_is_refused_with_the_key() -> None:
    config = load_experiment(DEMO)
    with pytest.raises(ConfigError, match=r"ppo\.loss_agg_mode 'per-rollout-mean' has no verl"):
        verl_config(load_experiment(DEMO, {"ppo.loss_agg_mode": "per-rollout-mean"}))
    with pytest.raises(ConfigError, match=r"optim\.mini_batch_rollouts must be a whole number of groups"):
        verl_config(load_experiment(DEMO, {"optim.mini_batch_rollouts": 12}))
    with pytest.raises(ConfigError, match="must divide among the 3 GPUs"):
        verl_config(load_experiment(DEMO, {"verl.n_gpus_per_node": 3}))
    # verl's own checks, through [verl] overrides: a mini-batch larger than the batch
    too_big = dataclasses.replace(
        config,
        verl=dataclasses.replace(config.verl, overrides=("actor_rollout_ref.actor.ppo_mini_batch_size=64",)),
    )
    with pytest.raises(ConfigError, match=r"verl 0\.9\.1 refuses the translated config"):
        verl_config(too_big)


def test_the_trainer_seam_is_verls_ray_ppo_trainer() -> None:
    cls = trainer_class()
    assert issubclass(cls, RayPPOTrainer)
    for method in ("train_on", "sync_weights", "sleep_replicas", "replica_addresses"):
        assert callable(getattr(cls, method))
    # what train_on calls on verl's trainer exists in this verl
    for name in ("_balance_batch", "_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"):
        assert callable(getattr(RayPPOTrainer, name)), name


# ================================================================= batches -> verl's step, on CPU
@pytest_asyncio.fixture
async def server() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=1.0)) as running:
        yield running


async def a_batch(server: RunningServer) -> Any:
    """Two groups of four rollouts of varied lengths and rewards, with recorded log-probs."""
    address = f"127.0.0.1:{server.port}"
    rng = np.random.default_rng(5)
    async with StoreClient(address) as store, TrainerClient(address) as trainer:
        groups = await trainer.submit_groups(["a", "b"], 4)
        plays = {}
        for g in groups:
            for rid in g.rollout_ids:
                prompt = rng.integers(1, 500, int(rng.integers(2, 9))).tolist()
                response = rng.integers(1, 500, int(rng.integers(1, 7))).tolist()
                plays[rid] = Play(calls=[(prompt, response)], reward=float(rng.integers(0, 3)) / 2)
        await run_rollouts(store, plays, 8)
        return await trainer.get_batch(min_groups=2, pad_token_id=0)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
async def test_our_batch_through_verls_advantage_and_ppo_loss_equals_our_loop(
    server: RunningServer, loss_agg_mode: str
) -> None:
    batch = await a_batch(server)
    data = data_proto(batch, temperature=1.0)
    assert len(data) == len(batch) == 8
    assert data.non_tensor_batch["uid"].tolist() == batch.uid.tolist()

    # GRPO advantage: verl's compute_advantage on the DataProto, ours from the rollout rewards
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(data, adv_estimator="grpo", norm_adv_by_std_in_grpo=True)
    rewards, groups = rollout_rewards_and_groups(batch.arrays, batch.uid)
    mask = torch.from_numpy(batch.arrays["response_mask"]).float()
    index = torch.from_numpy(batch.arrays["rollout_index"]).long()
    ours = ppo.broadcast_to_rows(ppo.grpo_outcome_advantage(rewards, groups), index, mask)
    assert_close(data.batch["advantages"], ours, rtol=1e-5, atol=1e-6)
    assert ours.abs().sum() > 0  # the rewards differ within groups: not a trivial zero

    # PPO loss: verl's ppo_loss (its engine's no-padding path), ours on the padded tensors
    old = data.batch["rollout_log_probs"]
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * mask
    data.batch["old_log_probs"] = old
    td = left_right_2_no_padding(data.to_tensordict())
    tokens = int(mask.sum())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=tokens, global_batch_size=len(batch))
    actor = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=8,
        rollout_n=4,
        clip_ratio=0.2,
        loss_agg_mode=loss_agg_mode,
    )
    theirs, _ = ppo_loss(actor, {"log_probs": unpadded(new, batch.arrays)}, td)
    mine, _ = ppo.compute_actor_loss(
        ppo.PPOConfig(loss_agg_mode=loss_agg_mode),  # type: ignore[arg-type]
        old,
        new,
        ours,
        mask,
        dp_size=1,
        batch_num_tokens=tokens,
        global_batch_size=len(batch),
    )
    assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def unpadded(response_values: torch.Tensor, arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """[B, R] per-response-token values as the model's output over each row's tokens, one flat run:
    the value of response token j of a row sits at the position predicting it (its prompt's end + j)."""
    prompt_lengths = arrays["prompt_lengths"].tolist()
    response_lengths = arrays["response_lengths"].tolist()
    flat = torch.zeros(sum(prompt_lengths) + sum(response_lengths))
    at = 0
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        flat[at + p - 1 : at + p - 1 + r] = response_values[row, :r]
        at += p + r
    return flat


# ================================================================= the rollout side of the seam
@pytest_asyncio.fixture
async def stack_with_a_replica(engine: Engine) -> AsyncIterator[tuple[RunningServer, LLMProxy]]:
    """A Store and a proxy whose backend is registered as verl registers its vLLM replicas: from a
    bare "host:port" address (the embedded engine speaks vLLM's dialect, token ids included)."""
    server = await start_server(ServerConfig(port=0, grace=1.0))
    address = engine.api_base.removeprefix("http://").removesuffix("/v1")
    backends = replica_backends(
        [address], model_name=MODEL, served_model=engine.served_model, policy_version=2
    )
    assert [(b.api_base, b.policy_version) for b in backends] == [(engine.api_base, 2)]
    proxy = await LLMProxy(ProxyConfig(store=f"127.0.0.1:{server.port}", backends=backends)).start()
    try:
        yield server, proxy
    finally:
        await proxy.stop(5)
        await server.stop()


async def test_rollouts_through_a_replica_become_a_data_proto_of_the_sampled_ids(
    stack_with_a_replica: tuple[RunningServer, LLMProxy], tokenizer: Any
) -> None:
    server, proxy = stack_with_a_replica
    address = f"127.0.0.1:{server.port}"
    async with StoreClient(address) as store, TrainerClient(address) as trainer:
        [group] = await trainer.submit_groups([{"task": "lock"}], 2)
        answers: dict[str, list[dict[str, Any]]] = {}
        for claimed in await store.dequeue_rollouts(2, worker_id="w", wait=5):
            attempt = claimed.latest_attempt
            assert attempt is not None
            endpoint = proxy.proxy_llm(MODEL).for_attempt(claimed.rollout_id, attempt.attempt_id).endpoint
            client = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
            try:
                answers[claimed.rollout_id] = await two_turns(client, digit_bias(tokenizer), stream=False)
            finally:
                await client.close()
            reward = 1.0 if len(answers) == 1 else 0.0
            await store.add_spans(
                [reward_span(reward)], rollout_id=claimed.rollout_id, attempt_id=attempt.attempt_id
            )
            await store.complete_attempt(claimed.rollout_id, attempt.attempt_id, "succeeded")
        batch = await trainer.get_batch(min_groups=1, pad_token_id=0)
    data = data_proto(batch, temperature=1.0)
    assert len(data) == 4  # two rollouts x two calls (transition rows)
    for row in range(len(data)):
        rid = data.non_tensor_batch["rollout_id"][row]
        turn = batch.rows[row].turn_index
        answer = answers[rid][turn]
        p_len, r_len = int(batch.arrays["prompt_lengths"][row]), int(batch.arrays["response_lengths"][row])
        prompts, responses = data.batch["prompts"][row], data.batch["responses"][row]
        assert prompts[prompts.shape[0] - p_len :].tolist() == chat_ids(tokenizer, answer["messages"])
        assert responses[:r_len].tolist() == answer["ids"]
        assert data.non_tensor_batch["uid"][row] == group.group_id
        assert data.batch["attention_mask"][row].sum() == p_len + r_len
    rewards = data.batch["rm_scores"].sum(dim=-1).tolist()
    assert sorted(rewards) == [0.0, 0.0, 0.0, 1.0]  # the final reward on each rollout's last call
    assert data.meta_info["global_token_num"] == data.batch["attention_mask"].sum(dim=-1).tolist()
