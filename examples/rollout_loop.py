#!/usr/bin/env python3
"""A trainer's rollout loop that survives a preemption.

  1. start N episodes on a `stasis serve` (local provider, the built-in
     tasks, the scripted model solving them);
  2. every K steps (model calls, over all the episodes) take a checkpoint,
     keeping the newest two;
  3. after the first checkpoint, preempt: SIGKILL the server and every
     sandbox, start a new server on the same state directory, restore the
     latest committed checkpoint, and go on;
  4. once every episode has ended, verify each (its reward) and read its
     token ids and logprobs from its ledger (GET /v1/episodes/ID/ledger,
     page by page: Client.ledger), as a trainer batches them; print every
     episode's reward and token count.

    STASIS_BIN=./bin/stasis python3 examples/rollout_loop.py --episodes 3 --checkpoint-every 4

The model is the scripted one (`stasis model`, what serve embeds) run as
a server of its own with 2 ms per generated token, as `stasis run` does, so
that checkpoints fall mid-episode; like a trainer's inference server it
survives the environment server's preemption. --embedded-model uses the
server's own instead (unslowed: an episode is then mostly over by the time
its start returns).

It needs a built stasis (make build: bin/stasis and bin/stasis-sandbox
beside it) and Linux with bubblewrap, as the local provider does. The state
directory is a fresh temporary one, removed at the end, unless --state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

try:
    import stasis
except ImportError:  # run from the repository without installing the client
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
    import stasis
from stasis.local import LocalServer, ScriptedModel

# Built-in tasks whose tests need only Python or a shell.
DEFAULT_TASKS = ["py-ini-value-with-equals", "sh-renext-spaces", "py-money-negative-cents", "sh-envget-unanchored-key", "py-config-defaults-mutated", "sh-logrotate-shift-order"]


def log(msg: str) -> None:
    print(msg, flush=True)


def rollout(server: LocalServer, n: int, k: int, tasks: list[str], deadline: float) -> list[dict]:
    c = server.client()

    async def start_all() -> list[stasis.Episode]:
        # Starts take a while (a sandbox each): make them at once.
        async with stasis.AsyncClient(client=c) as ac:
            return await asyncio.gather(*(ac.start_episode(tasks[i % len(tasks)], "mini", id=f"rollout-{i:03d}") for i in range(n)))

    ids = [ep.id for ep in asyncio.run(start_all())]
    log(f"started {n} episodes: " + ", ".join(f"{e} ({tasks[i % len(tasks)]})" for i, e in enumerate(ids)))

    mark, checkpoints, preempted, resumed = 0, [], False, {}
    while True:
        eps = [e for e in c.list_episodes() if e.id in ids]
        steps = sum(e.model_calls for e in eps)
        if all(e.harness_ended for e in eps):
            break
        if steps - mark >= k:
            ck = c.create_checkpoint()
            live = sum(1 for f in ck.episodes if not f.excluded)
            log(f"step {steps}: checkpoint {ck.checkpoint} committed ({live} episodes, {ck.seconds:.2f} s)")
            checkpoints.append(ck.checkpoint)
            mark = steps
            for old in checkpoints[:-2]:  # keep the newest two
                c.delete_checkpoint(old)
            checkpoints = checkpoints[-2:]
            if not preempted:
                # The machine is taken away: the server and every sandbox die.
                killed = server.preempt()
                log(f"preempted: SIGKILL to the server and {killed} sandboxes")
                server.start()
                c = server.client()
                states = [e.state for e in c.list_episodes() if e.id in ids]
                log(f"new server on the same state: {states.count('lost')} episodes lost, {states.count('ended')} ended")
                latest = c.latest_checkpoint()
                res = c.restore_checkpoint(latest.id)
                resumed = {f.episode: f.resume or "none" for f in res.episodes}
                log(f"restored {latest.id}: " + ", ".join(f"{e} {r}" for e, r in sorted(resumed.items())) + f" ({res.seconds:.2f} s)")
                preempted = True
                mark = sum(e.model_calls for e in c.list_episodes() if e.id in ids)
        if time.monotonic() > deadline:
            raise TimeoutError("the episodes did not end in time")
        time.sleep(0.25)  # poll interval, bounded by the deadline

    # The batch: each episode's reward, and every model call's tokens.
    batch = []
    for id in ids:
        verdict = c.verify_episode(id).verdict
        ledger = c.ledger(id, bodies=False)  # the whole logical ledger, through the API; tokens, not the bodies
        turns = [
            {
                "prompt_token_ids": e.tokens.prompt_token_ids,
                "completion_token_ids": e.tokens.completion_token_ids,
                "logprobs": e.tokens.logprobs,
                "mask": e.boundary,  # the first call after a relaunch: not trained on
            }
            for e in ledger.entries
            if e.tokens is not None
        ]
        if ledger.broken:  # a relaunch that did not match: not to be trained on
            log(f"{id}: its history is broken ({ledger.reason}): its calls are left out of the batch")
            turns = []
        batch.append(
            {
                "episode": id,
                "task": verdict.task,
                "reward": verdict.reward,
                "calls": len(ledger.entries),
                "tokens": sum(len(t["completion_token_ids"]) for t in turns),
                "logprobs": sum(len(t["logprobs"]) for t in turns),
                "resumed": resumed.get(id, "-"),
                "broken": ledger.broken,
                "turns": turns,
            }
        )
        c.retire_episode(id)
    if not preempted:
        log(f"no preemption: the episodes ended before {k} steps")
    return batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=3, help="how many episodes (default 3)")
    p.add_argument("--checkpoint-every", type=int, default=4, metavar="K", help="take a checkpoint every K model calls (default 4)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="task ids, taken in turn")
    p.add_argument("--binary", help="the stasis binary (default $STASIS_BIN, else stasis on $PATH)")
    p.add_argument("--state", help="the server's state directory (default: a fresh one, removed at the end)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds (default 600)")
    p.add_argument("--token-delay", default="2ms", help="the scripted model's time per generated token (default 2ms)")
    p.add_argument("--embedded-model", action="store_true", help="use the server's embedded scripted model (no delay)")
    p.add_argument("--json", metavar="FILE", help="also write the batch's summary to FILE as JSON")
    a = p.parse_args()
    if a.episodes < 1 or a.checkpoint_every < 1:
        p.error("--episodes and --checkpoint-every must be at least 1")

    start = time.monotonic()
    made = a.state is None
    state = tempfile.mkdtemp(prefix="stasis-rollout-") if made else os.path.abspath(a.state)
    model = None if a.embedded_model else ScriptedModel(binary=a.binary, token_delay=a.token_delay)
    server = None
    try:
        args = []
        if model is not None:
            args = ["--model-upstream", model.start()]
        server = LocalServer(os.path.join(state, "state") if made else state, binary=a.binary, args=args)
        server.start()
        batch = rollout(server, a.episodes, a.checkpoint_every, a.tasks.split(","), start + a.timeout)
    finally:
        left = []
        if server is not None:
            server.close()
            left = server.leftovers()
        if model is not None:
            model.close()
            if model.identity is not None and model.identity.alive():
                left.append(model.identity)
        if made:
            shutil.rmtree(state, ignore_errors=True)
    if left:
        print(f"processes left running: {left}", file=sys.stderr)
        return 1

    log("")
    log(f"{'episode':<13} {'task':<28} {'reward':>6} {'calls':>5} {'tokens':>6} {'logprobs':>8}  resumed")
    for r in batch:
        log(f"{r['episode']:<13} {r['task']:<28} {r['reward']:>6} {r['calls']:>5} {r['tokens']:>6} {r['logprobs']:>8}  {r['resumed']}")
    resolved = sum(r["reward"] for r in batch)
    log(f"resolved {resolved}/{len(batch)}, {sum(r['tokens'] for r in batch)} completion tokens, {time.monotonic() - start:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "turns"} for r in batch], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
