"""Several addresses for one store (its writer and standbys): the clients' channel tries them in order."""

from __future__ import annotations

import socket

import pytest

from lightning_grpc.client import StoreClient
from lightning_grpc.client.channel import channel_target
from lightning_grpc.errors import InvalidArgumentError
from lightning_grpc.server.app import RunningServer


def test_one_address_or_a_grpc_uri_is_passed_on_as_written() -> None:
    for target in ("127.0.0.1:4747", "store.example:4747", "dns:///a.example:1,b", "unix:/tmp/s.sock"):
        assert channel_target(target) == target


def test_several_addresses_become_one_ordered_address_list() -> None:
    assert channel_target("127.0.0.1:1, localhost:2,127.0.0.1:1") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("[::1]:5,[::1]:6") == "ipv6:[::1]:5,[::1]:6"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("a,b", "'a' of 'a,b' is not host:port"),
        ("127.0.0.1:1,127.0.0.1:x", "'127.0.0.1:x' of '127.0.0.1:1,127.0.0.1:x' is not host:port"),
        ("no-such-host.invalid:1,127.0.0.1:2", "cannot resolve 'no-such-host.invalid'"),
    ],
)
def test_a_bad_list_is_refused_naming_the_address(target: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        channel_target(target)
    assert message in err.value.message and err.value.field == "target"


async def test_a_client_given_a_dead_address_first_reaches_the_live_one(store_server: RunningServer) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    async with StoreClient(f"127.0.0.1:{dead},127.0.0.1:{store_server.port}") as client:
        [rollout] = await client.enqueue_rollouts([{"input": {"i": 1}}])
        assert (await client.get_rollout(rollout.rollout_id)).input == {"i": 1}
