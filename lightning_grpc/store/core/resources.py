"""Resources: versioned named sets (models, prompt templates, ...) that rollouts refer to."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from lightning_grpc.errors import AbortedError, AlreadyExistsError, InvalidArgumentError, Reason
from lightning_grpc.types import Page, Resource, ResourcesUpdate

from .. import paging, rows
from ..state import ResourcesState, Txn
from .limits import new_id
from .staging import SpanStaging
from .validation import check_id, check_resources


class ResourcesSection(SpanStaging):
    """Adding, updating, reading and listing resources."""

    async def add_resources(self, resources: dict[str, Resource], resources_id: str = "") -> ResourcesUpdate:
        self._check_writable()
        check_resources(resources)
        if resources_id:
            check_id(resources_id, "resources_id")
        fingerprint = hashlib.sha256(rows.resources_body(resources).encode()).hexdigest()
        existing = self._resources.get(resources_id) if resources_id else None
        if existing is not None:
            if existing.fingerprint != fingerprint or existing.resources.version != 1:
                raise AlreadyExistsError(
                    f"resources {resources_id} already exist with other contents",
                    reason=Reason.RESOURCES_ALREADY_EXIST,
                    resourcesId=resources_id,
                )
            await self._durable()
            return replace(existing.resources)
        now = self.clock()
        update = ResourcesUpdate(
            resources_id=resources_id or new_id("rs"),
            version=1,
            resources=dict(resources),
            create_time=now,
            update_time=now,
        )
        state = ResourcesState(update, fingerprint)
        self._resources[update.resources_id] = state
        self._latest_resources_id = update.resources_id
        tx = Txn(resources={update.resources_id: state}, meta={"latest_resources_id": update.resources_id})
        await self._apply(tx)
        return replace(update)

    async def update_resources(
        self, resources_id: str, resources: dict[str, Resource], expected_version: int = 0
    ) -> ResourcesUpdate:
        self._check_writable()
        state = self._resources_state(resources_id)
        check_resources(resources)
        if expected_version < 0:
            raise InvalidArgumentError("expected_version", "must not be negative")
        current = state.resources
        if expected_version and expected_version != current.version:
            raise AbortedError(
                f"resources {resources_id} are at version {current.version}, not {expected_version}",
                reason=Reason.RESOURCES_VERSION_MISMATCH,
                resourcesId=resources_id,
                version=str(current.version),
            )
        update = replace(
            current, resources=dict(resources), version=current.version + 1, update_time=self.clock()
        )
        state.resources = update
        state.fingerprint = hashlib.sha256(rows.resources_body(resources).encode()).hexdigest()
        self._latest_resources_id = resources_id
        tx = Txn(resources={resources_id: state}, meta={"latest_resources_id": resources_id})
        await self._apply(tx)
        return replace(update)

    async def get_resources(self, resources_id: str) -> ResourcesUpdate:
        state = self._resources_state(resources_id)
        await self._durable()
        return replace(state.resources)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        state = self._resources.get(self._latest_resources_id)
        await self._durable()
        return replace(state.resources) if state else None

    async def list_resources(
        self,
        *,
        resources_id_contains: str = "",
        descending: bool = False,
        page_size: int = 0,
        page_token: str = "",
    ) -> Page:
        size = paging.page_size(page_size)
        filters = paging.filter_hash(resources_id_contains, descending)

        def cursor(r: ResourcesUpdate) -> tuple[Any, ...]:
            return (r.update_time, r.resources_id)

        matches = sorted(
            (
                s.resources
                for s in self._resources.values()
                if resources_id_contains in s.resources.resources_id
            ),
            key=cursor,
            reverse=descending,
        )
        page, nxt = paging.keyset_page(
            matches, cursor, size, paging.read_token(page_token, filters), descending
        )
        await self._durable()
        return Page(
            items=[replace(r) for r in page],
            next_page_token=paging.make_token(nxt, filters) if nxt is not None else "",
            total_size=len(matches),
        )
