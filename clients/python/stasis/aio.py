"""An asyncio face of Client: each call runs the blocking client in a
thread pool, so many episodes can be driven from one event loop without a
third-party HTTP library.

    async with AsyncClient("unix:/run/stasis/api.sock") as c:
        eps = await asyncio.gather(*(c.start_episode(t, "mini") for t in tasks))
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from .client import Client
from .models import Checkpoint, CheckpointDetail, CheckpointResult, Episode, FreedSnapshot, Ledger, LedgerReport, Limits, RestoreResult, TaskSummary, VerifyResult

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient:
    """The methods of Client, as coroutines. Takes Client's arguments (or a
    ready ``client=``), and ``max_workers``: how many requests run at once."""

    def __init__(self, url: Optional[str] = None, *, client: Optional[Client] = None, max_workers: int = 16, **kw: Any):
        self.client = client if client is not None else Client(url, **kw)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="stasis")

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for the requests under way, and stop the threads."""
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._pool.shutdown, wait=True))

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    # The operations (one per operationId; see Client for what each does).

    async def start_episode(self, task: str, harness: str = "mini", *, id: Optional[str] = None, provider: Optional[str] = None, pause_mode: Optional[str] = None, deadline_s: Optional[float] = None, limits: Optional[Limits] = None, image: Optional[str] = None) -> Episode:
        return await self._run(self.client.start_episode, task, harness, id=id, provider=provider, pause_mode=pause_mode, deadline_s=deadline_s, limits=limits, image=image)

    async def list_episodes(self, *, state: Optional[str] = None, task: Optional[str] = None, harness: Optional[str] = None) -> list[Episode]:
        return await self._run(self.client.list_episodes, state=state, task=task, harness=harness)

    async def get_episode(self, id: str) -> Episode:
        return await self._run(self.client.get_episode, id)

    async def verify_episode(self, id: str) -> VerifyResult:
        return await self._run(self.client.verify_episode, id)

    async def retire_episode(self, id: str) -> Episode:
        return await self._run(self.client.retire_episode, id)

    async def get_ledger(self, id: str, *, after: Optional[int] = None, limit: Optional[int] = None, bodies: Optional[bool] = None) -> Ledger:
        return await self._run(self.client.get_ledger, id, after=after, limit=limit, bodies=bodies)

    async def verify_ledger(self, id: str) -> LedgerReport:
        return await self._run(self.client.verify_ledger, id)

    async def create_checkpoint(self, *, id: Optional[str] = None, stragglers: Optional[str] = None) -> CheckpointResult:
        return await self._run(self.client.create_checkpoint, id=id, stragglers=stragglers)

    async def list_checkpoints(self, *, state: Optional[str] = None, limit: Optional[int] = None) -> list[Checkpoint]:
        return await self._run(self.client.list_checkpoints, state=state, limit=limit)

    async def get_checkpoint(self, id: str) -> CheckpointDetail:
        return await self._run(self.client.get_checkpoint, id)

    async def delete_checkpoint(self, id: str) -> list[FreedSnapshot]:
        return await self._run(self.client.delete_checkpoint, id)

    async def restore_checkpoint(self, id: str, *, episodes: Optional[Sequence[str]] = None) -> RestoreResult:
        return await self._run(self.client.restore_checkpoint, id, episodes=episodes)

    async def branch_checkpoint(self, id: str, episode: str, *, copies: Optional[int] = None, ids: Optional[Sequence[str]] = None) -> CheckpointResult:
        return await self._run(self.client.branch_checkpoint, id, episode, copies=copies, ids=ids)

    async def list_tasks(self) -> list[TaskSummary]:
        return await self._run(self.client.list_tasks)

    async def metrics(self) -> str:
        return await self._run(self.client.metrics)

    async def healthz(self) -> bool:
        return await self._run(self.client.healthz)

    async def openapi(self) -> dict[str, Any]:
        return await self._run(self.client.openapi)

    # Built on them.

    async def latest_checkpoint(self, state: str = "committed") -> Optional[Checkpoint]:
        return await self._run(self.client.latest_checkpoint, state)

    async def wait_episodes(self, ids: Optional[Iterable[str]] = None, *, timeout: float = 600.0, poll: float = 0.5) -> list[Episode]:
        return await self._run(self.client.wait_episodes, list(ids) if ids is not None else None, timeout=timeout, poll=poll)

    async def ledger(self, id: str, *, bodies: bool = True) -> Ledger:
        return await self._run(self.client.ledger, id, bodies=bodies)
