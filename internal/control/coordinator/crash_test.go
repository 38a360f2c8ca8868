package coordinator_test

// The server killed at each step of a prepare and of a restore (and in a
// branch and a start). A step
// hook crashes the operation there: it returns at once, undoing and
// closing nothing, with its sandboxes, forks and harnesses left as they
// are; the host side is dropped (the coordinator, the gateway, the store)
// and the system opened again on the same state (what a restarted server
// does). Then, every time:
//
//   - no sandbox is left that no live episode runs in, and every live
//     episode's sandbox is there;
//   - no checkpoint is pending, and a snapshot exists exactly when a
//     committed checkpoint names it;
//   - no episode is left paused;
//   - a prepare leaves every ledger untouched; a restore either happened
//     for every episode (each live in its fork at the next attempt, the
//     gateway and the store agreeing) or for none (every row, gateway
//     attempt and ledger as it was): never half;
//
// and every committed checkpoint, those the interrupted prepares
// committed included, restores.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/coordinator/crashcheck"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/providers/local"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// snapRecorder is the local provider of one Open, remembering every
// snapshot made (the snapshot exists even when the caller dies before it
// hears of it) in a list that outlives the Open.
type snapRecorder struct {
	*local.Provider
	snaps *snapList
}

func (p snapRecorder) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	info, err := p.Provider.Snapshot(ctx, id, name)
	if err == nil {
		p.snaps.add(info.ID)
	}
	return info, err
}

// snapList is every snapshot made, across the Opens.
type snapList struct {
	mu    sync.Mutex
	snaps []string
}

func (l *snapList) add(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.snaps = append(l.snaps, id)
}

func (l *snapList) made() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.snaps...)
}

// killAt crashes the n-th step named step of operation op.
type killAt struct {
	op, step string
	n        int
	mu       sync.Mutex
	seen     int
}

func (k *killAt) hook(op, step, episode string) error {
	if op != k.op || step != k.step {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.seen++
	if k.seen == k.n {
		return fmt.Errorf("server killed before %s #%d (%s)", step, k.n, episode)
	}
	return nil
}

func (k *killAt) String() string { return fmt.Sprintf("%s:%s#%d", k.op, k.step, k.n) }

// killRig is a world with two episodes held at their third model call.
// Its coordinator (that of the system open now: c) calls the rig's step
// hook, which kills the operation at kill when one is set.
type killRig struct {
	t     *testing.T
	ctx   context.Context
	w     *world
	snaps *snapList
	c     *coordinator.Coordinator
	eps   []string

	mu   sync.Mutex
	kill *killAt // nil: no operation is killed
}

func newKillRig(t *testing.T, ctx context.Context) *killRig {
	r := &killRig{t: t, ctx: ctx, snaps: &snapList{}, eps: []string{"ep-a", "ep-b"}}
	r.w = newWrappedWorld(t, func(p *local.Provider) sandbox.Provider { return snapRecorder{Provider: p, snaps: r.snaps} },
		func(c *system.Config) {
			c.CoordinatorOptions = func(o *coordinator.Options) {
				coordinator.SetStepHook(o, r.hook)
				// The recovery's log is the test's.
				o.Logger = slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
			}
		})
	r.c = r.w.Coordinator
	var holds []*relay.Hold
	for _, ep := range r.eps {
		holds = append(holds, r.w.Hold(ep, 3))
		r.holdCalls(ep, 0, 4, 12)
		if _, err := r.c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
	}
	for i, h := range holds {
		waitHeld(t, ctx, h, "call 3 of "+r.eps[i])
	}
	return r
}

// hook is the coordinator's step hook: it kills the operation at r.kill.
func (r *killRig) hook(op, step, episode string) error {
	r.mu.Lock()
	k := r.kill
	r.mu.Unlock()
	if k == nil {
		return nil
	}
	return k.hook(op, step, episode)
}

// holdCalls holds calls from to last of an episode's attempt at the
// gateway (each until the test ends): a crash closes the gateway's
// sockets, cutting the call held, and the harness asks again under the
// next number.
func (r *killRig) holdCalls(ep string, attempt, from, last int) {
	for n := from; n <= last; n++ {
		r.w.HoldAttempt(ep, attempt, attempt*1_000_000+n)
	}
}

// holdNext holds the first model calls of each episode's next attempt,
// so that a restored harness makes no progress while the test looks.
func (r *killRig) holdNext() {
	for _, ep := range r.eps {
		st, err := r.w.Gateway.Episode(ep)
		if err != nil {
			r.t.Fatal(err)
		}
		r.holdCalls(ep, st.Attempt+1, 1, 8)
	}
}

// crash runs do with the coordinator, its step hook killing it at k,
// checks that it was killed, then drops everything in memory (the host
// side crashes) and opens the system again on what is on disk.
func (r *killRig) crash(k *killAt, do func(*coordinator.Coordinator) error) {
	t := r.t
	t.Helper()
	r.mu.Lock()
	r.kill = k
	r.mu.Unlock()
	err := do(r.c)
	r.mu.Lock()
	r.kill = nil
	r.mu.Unlock()
	if !errors.Is(err, coordinator.ErrCrashed) {
		t.Fatalf("%s: the operation was not killed: %v", k, err)
	}
	r.w.Crash()
	r.w.Reopen()
	r.c = r.w.Coordinator
}

// testLog writes a log into the test's.
type testLog struct{ t *testing.T }

func (l testLog) Write(b []byte) (int, error) {
	l.t.Helper()
	l.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// before is what a restore must leave as it was if it is undone.
type before struct {
	rows     map[string]store.Episode
	attempts map[string]int
	ledgers  map[string]string
}

func (r *killRig) before() before {
	b := before{rows: map[string]store.Episode{}, attempts: map[string]int{}, ledgers: map[string]string{}}
	for _, ep := range r.eps {
		row, err := r.w.Store.GetEpisode(r.ctx, ep)
		if err != nil {
			r.t.Fatal(err)
		}
		b.rows[ep] = row
		st, err := r.w.Gateway.Episode(ep)
		if err != nil {
			r.t.Fatal(err)
		}
		b.attempts[ep] = st.Attempt
		b.ledgers[ep] = r.ledgerState(ep)
	}
	return b
}

// ledgerState is the logical ledger of an episode: its entries (by seq and
// hash) and its cuts and broken marks. Settlements (what became of a
// response, recorded when the relay learns it) do not change it.
func (r *killRig) ledgerState(ep string) string {
	h, err := ledger.ReadIn(r.w.Gateway.Ledgers(), ep)
	if err != nil {
		r.t.Fatal(err)
	}
	var b strings.Builder
	for _, e := range h.Entries {
		fmt.Fprintf(&b, "entry %d %s %s\n", e.Seq, e.CallID, e.Hash)
	}
	for _, ev := range h.Events {
		fmt.Fprintf(&b, "%s %d→%d %s\n", ev.Kind, ev.From, ev.To, ev.Reason)
	}
	return b.String()
}

// check checks what must hold after every recovery (crashcheck.Check).
func (r *killRig) check(what string) {
	r.t.Helper()
	s := crashcheck.System{Coordinator: r.c, Provider: r.w.local, Store: r.w.Store, Gateway: r.w.Gateway}
	if err := crashcheck.Check(r.ctx, s, r.snaps.made()); err != nil {
		r.t.Fatalf("%s: %v", what, err)
	}
}

// retireAll retires the live episodes, so that a checkpoint of them can
// be restored.
func (r *killRig) retireAll() {
	for _, id := range r.c.LiveIDs() {
		if err := r.c.Retire(r.ctx, id); err != nil {
			r.t.Fatal(err)
		}
	}
}

func (r *killRig) liveIDs() []string {
	ids := r.c.LiveIDs()
	sort.Strings(ids)
	return ids
}

// TestKillEveryStep kills the server at each step of a prepare, then at
// each step of a restore, then in a branch and in a start, and checks
// what a new server leaves (killRig).
func TestKillEveryStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	start := time.Now()
	r := newKillRig(t, ctx)
	if _, err := r.c.Prepare(ctx, "ck-0"); err != nil {
		t.Fatal(err)
	}
	committed := []string{"ck-0"}

	for _, k := range []*killAt{
		{op: "prepare", step: "pause", n: 1},
		{op: "prepare", step: "snapshot", n: 1},
		{op: "prepare", step: "snapshotted", n: 2},
		{op: "prepare", step: "record", n: 2},
		{op: "prepare", step: "recorded", n: 1},
		{op: "prepare", step: "commit", n: 1},
		{op: "prepare", step: "continue", n: 1},
		{op: "prepare", step: "close", n: 1},
	} {
		ck := "ck-" + k.step
		b := r.before()
		r.crash(k, func(c *coordinator.Coordinator) error { _, err := c.Prepare(ctx, ck); return err })
		r.check(k.String())
		if ids := r.liveIDs(); !reflect.DeepEqual(ids, r.eps) {
			t.Fatalf("%s: live after the recovery: %v, want %v", k, ids, r.eps)
		}
		for _, ep := range r.eps {
			if got := r.ledgerState(ep); got != b.ledgers[ep] {
				t.Fatalf("%s: the prepare changed the ledger of %s:\n%s\nwas\n%s", k, ep, got, b.ledgers[ep])
			}
		}
		meta, _, err := r.w.Store.Get(ctx, ck)
		if err != nil {
			t.Fatal(err)
		}
		wantCommitted := k.step == "continue" || k.step == "close"
		if (meta.State == store.StateCommitted) != wantCommitted {
			t.Fatalf("%s: checkpoint %s is %s after the recovery", k, ck, meta.State)
		}
		if wantCommitted {
			committed = append(committed, ck)
		} else if !strings.Contains(meta.Error, "interrupted") {
			t.Fatalf("%s: checkpoint %s failed for %q, not as interrupted", k, ck, meta.Error)
		}
		t.Logf("%s: recovered, checkpoint %s %s (%.0fs)", k, ck, meta.State, time.Since(start).Seconds())
	}

	// Restores: before the decision a crash is undone, after it rolled
	// forward. Those rolled forward restore every committed checkpoint.
	next := 0
	for _, k := range []*killAt{
		{op: "restore", step: "fork", n: 1},
		{op: "restore", step: "forked", n: 2},
		{op: "restore", step: "ready", n: 2},
		{op: "restore", step: "decide", n: 1},
		{op: "restore", step: "advance", n: 2},
		{op: "restore", step: "go", n: 1},
		{op: "restore", step: "go", n: 2},
		{op: "restore", step: "close", n: 1},
	} {
		forward := k.step == "advance" || k.step == "go" || k.step == "close"
		ck := committed[0]
		if forward {
			ck = committed[next%len(committed)]
			next++
		}
		r.retireAll()
		b := r.before()
		r.holdNext()
		// The episodes are retired: a restore brings them back when named.
		_, recs, err := r.w.Store.Get(ctx, ck)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, rec := range recs {
			names = append(names, rec.Episode)
		}
		r.crash(k, func(c *coordinator.Coordinator) error {
			_, err := c.RestoreWith(ctx, ck, coordinator.RestoreOptions{Episodes: names})
			return err
		})
		r.check(k.String())
		ids := r.liveIDs()
		if !forward {
			if len(ids) > 0 {
				t.Fatalf("%s: a restore killed before its decision left %v live", k, ids)
			}
			for _, ep := range r.eps {
				row, _ := r.w.Store.GetEpisode(ctx, ep)
				st, _ := r.w.Gateway.Episode(ep)
				row.Updated = b.rows[ep].Updated
				if !reflect.DeepEqual(row, b.rows[ep]) || st.Attempt != b.attempts[ep] || r.ledgerState(ep) != b.ledgers[ep] {
					t.Fatalf("%s: undone, but episode %s changed: row %+v (was %+v), attempt %d (was %d)", k, ep, row, b.rows[ep], st.Attempt, b.attempts[ep])
				}
			}
			t.Logf("%s: undone (%.0fs)", k, time.Since(start).Seconds())
			continue
		}
		if !reflect.DeepEqual(ids, r.eps) {
			t.Fatalf("%s: a restore killed after its decision left %v live, want every episode: %v", k, ids, r.eps)
		}
		for _, ep := range r.eps {
			e, _ := r.c.Live(ep)
			row, _ := r.w.Store.GetEpisode(ctx, ep)
			if e.Attempt() != b.attempts[ep]+1 || row.Attempt != e.Attempt() || row.Resume != "relaunch" {
				t.Fatalf("%s: rolled forward, but %s is at attempt %d (row %+v), want %d", k, ep, e.Attempt(), row, b.attempts[ep]+1)
			}
			// A relaunch's gateway matches its next call against the
			// ledger; until then the ledger is as it was.
			if got := r.ledgerState(ep); got != b.ledgers[ep] {
				t.Fatalf("%s: the ledger of %s changed before its relaunched harness called:\n%s\nwas\n%s", k, ep, got, b.ledgers[ep])
			}
		}
		t.Logf("%s: rolled forward, checkpoint %s restored (%.0fs)", k, ck, time.Since(start).Seconds())
	}
	if next < len(committed) {
		t.Fatalf("only %d of the %d committed checkpoints were restored", next, len(committed))
	}

	// Branches: undone wherever they are killed, their copies being
	// episodes nothing names yet.
	for _, k := range []*killAt{
		{op: "branch", step: "register", n: 1},
		{op: "branch", step: "close", n: 1},
	} {
		copies := []string{"ep-a-" + k.step}
		r.crash(k, func(c *coordinator.Coordinator) error {
			_, err := c.Branch(ctx, committed[0], "ep-a", copies)
			return err
		})
		r.check(k.String())
		if ids := r.liveIDs(); !reflect.DeepEqual(ids, r.eps) {
			t.Fatalf("%s: live after the recovery: %v, want %v", k, ids, r.eps)
		}
		for _, cp := range copies {
			if _, err := r.w.Store.GetEpisode(ctx, cp); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("%s: copy %s is in the store: %v", k, cp, err)
			}
			if st, err := r.w.Gateway.Episode(cp); err == nil {
				t.Fatalf("%s: copy %s is still registered at the gateway: %+v", k, cp, st)
			}
		}
		t.Logf("%s: undone (%.0fs)", k, time.Since(start).Seconds())
	}

	// Starts: undone, their id free again.
	for _, k := range []*killAt{
		{op: "start", step: "start", n: 1},
		{op: "start", step: "started", n: 1},
	} {
		id := "ep-" + k.step
		r.crash(k, func(c *coordinator.Coordinator) error {
			_, err := c.Start(ctx, id, "sh-renext-spaces", "mini")
			return err
		})
		r.check(k.String())
		if _, err := r.w.Store.GetEpisode(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s: %s is in the store: %v", k, id, err)
		}
		if st, err := r.w.Gateway.Episode(id); err == nil {
			t.Fatalf("%s: %s is still registered at the gateway: %+v", k, id, st)
		}
		t.Logf("%s: undone (%.0fs)", k, time.Since(start).Seconds())
	}

	r.retireAll()
	for _, ck := range committed {
		if _, err := r.c.DeleteCheckpoint(ctx, ck); err != nil {
			t.Fatal(err)
		}
	}
	cks, _ := r.w.Store.List(ctx, store.ListOptions{State: store.StateFailed})
	for _, ck := range cks {
		if _, err := r.c.DeleteCheckpoint(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("every kill recovered in %.0fs", time.Since(start).Seconds())
}
