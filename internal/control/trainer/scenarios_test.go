package trainer_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"stasis/client"
	"stasis/errdefs"
	"stasis/internal/control/model"
	"stasis/internal/s3test"
	"stasis/internal/storage/store"
)

// TestScenarios are the fixed scenarios of issue 23 beside the random
// sequences, each on a world of its own, driven through the API as the
// sequences are and held to the same invariants (checkInvariants) at its
// end.
func TestScenarios(t *testing.T) {
	s3 := s3test.Start(t)
	s3.Setenv(t)
	for _, sc := range []struct {
		name  string
		nodes int
		run   func(d *driver)
		opts  []func(*world)
	}{
		{"second crash before the restored episodes call", 2, secondCrashBeforeNextCall, nil},
		{"same checkpoint restored twice", 2, sameCheckpointTwice, nil},
		// One episode at a time: the last ones finish while the first
		// are paused and snapshotted.
		{"episodes finish while a checkpoint is prepared", 1, finishDuringPrepare, []func(*world){func(w *world) { w.concurrency = 1 }}},
		{"verify running when a checkpoint begins", 2, verifyDuringCheckpoint, nil},
		{"checkpoint during which no response reaches a harness", 2, quietCheckpoint, nil},
	} {
		t.Run(sc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			log := newSeqLog()
			t.Cleanup(func() {
				if t.Failed() || testing.Verbose() {
					t.Logf("what the scenario did:\n%s", log)
				}
			})
			d := newDriver(nil, 1, maxEpisodes)
			d.w = newWorld(t, ctx, s3, maxEpisodes, sc.nodes, log, sc.opts...)
			sc.run(d)
			d.drain()
			d.checkInvariants()
		})
	}
}

// awaitLedger waits until episode id's ledger has n live entries.
func (d *driver) awaitLedger(id string, n int64) {
	ctx, cancel := context.WithTimeout(d.w.ctx, time.Minute)
	defer cancel()
	for {
		l, err := api2(d).Ledger(ctx, id, 0, 1, false)
		if err == nil && l.Live >= n {
			return
		}
		select {
		case <-ctx.Done():
			d.fatalf("%s's ledger never had %d entries: %v %v", id, n, l.Live, err)
		case <-time.After(20 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
}

// releaseN lets n calls of episode id through, one after the other.
func (d *driver) releaseN(id string, n int) {
	for range n {
		d.release(id)
	}
}

// A second crash before a restored episode makes its next call: the
// restore's attempt made no call (the model answered none of its run, and
// its ledger has no entry of it), and the second restore of the same
// checkpoint continues each episode from the same place as its next
// attempt.
func secondCrashBeforeNextCall(d *driver) {
	a, b := d.start(), d.start()
	d.releaseN(a.id, 2)
	d.releaseN(b.id, 1)
	c := d.checkpoint("checkpoint")
	d.releaseN(a.id, 1) // the dead run's call: after the checkpoint
	d.crash(2)
	d.restore(c, nil)
	first := map[string]int{}
	for _, e := range []*episode{a, b} {
		first[e.id] = e.attempt
		held := d.awaitHeld(e.id)
		if want := int(c.positions[e.id]); held.Turn != want {
			d.fatalf("%s, restored from %s at %d, asks for turn %d", e.id, c.id, want, held.Turn)
		}
	}
	d.logf("both restored episodes' next calls are held at the model")
	d.crash(2)
	d.restore(c, nil)
	for _, e := range []*episode{a, b} {
		if e.attempt != first[e.id]+1 {
			d.fatalf("%s: the second restore made attempt %d, after %d", e.id, e.attempt, first[e.id])
		}
		n := len(e.runs)
		if calls := callsOf(d.w.gate.Passed(), e, e.runs[n-2]); calls != 0 {
			d.fatalf("%s: the first restore's run (%s), crashed before its next call, made %d calls", e.id, e.runs[n-2].why, calls)
		}
	}
}

// callsOf counts the calls the model answered in run r of episode e.
func callsOf(passed []model.GateCall, e *episode, r run) int {
	n := 0
	for i, c := range passed {
		if c.Script != e.task || i < r.from {
			continue
		}
		// The run ends where the next begins.
		k := slices.Index(e.runs, r)
		if k+1 < len(e.runs) && i >= e.runs[k+1].from {
			continue
		}
		n++
	}
	return n
}

// The same checkpoint restored twice, after the first restore's episodes
// made calls: the second restore's lineage leaves them out (the ledger
// goes back to the checkpoint's history; checkLedgers holds each entry to
// the lineage, and here no live entry may be of the first restore's
// attempt).
func sameCheckpointTwice(d *driver) {
	a, b := d.start(), d.start()
	d.releaseN(a.id, 1)
	d.releaseN(b.id, 2)
	c := d.checkpoint("checkpoint")
	d.crash(2)
	d.restore(c, nil)
	dead := map[string]int{a.id: a.attempt, b.id: b.attempt}
	d.releaseN(a.id, 2)
	d.releaseN(b.id, 1)
	d.awaitLedger(a.id, c.positions[a.id]+2)
	d.awaitLedger(b.id, c.positions[b.id]+1)
	d.logf("the first restore's episodes made calls, recorded in their ledgers")
	d.crash(1)
	d.restore(c, nil)
	d.releaseN(a.id, 1)
	d.releaseN(b.id, 1)
	api, _ := d.api()
	for id, attempt := range dead {
		l, err := api.Ledger(d.w.ctx, id, 0, 0, false)
		if err != nil {
			d.fatalf("%s's ledger: %v", id, err)
		}
		for _, e := range l.Entries {
			if e.Attempt == attempt {
				d.fatalf("%s's ledger holds entry %d (%s) of attempt %d, the run the second restore of %s left", id, e.Seq, e.CallID, attempt, c.id)
			}
		}
		dropped := 0
		for _, e := range l.Dropped {
			if e.Attempt == attempt {
				dropped++
			}
		}
		if dropped == 0 {
			d.fatalf("%s's ledger keeps none of the left run's (attempt %d) entries as dropped: %s", id, attempt, ledgerString(l))
		}
	}
}

// Episodes finish while a checkpoint is being prepared: their last calls
// are let through once the checkpoint is open, and the node prepares one
// episode at a time (--concurrency 1), so the last ones end while the
// first are paused and snapshotted. Each is recorded either finished
// (verified by the checkpoint; at least one is) or paused before its last
// answer reached it; none is lost, and none is verified twice (sawVerdict
// holds every verdict of an attempt to the first). A crash and a restore
// of the checkpoint bring each back as recorded.
func finishDuringPrepare(d *driver) {
	var eps []*episode
	for range 3 {
		eps = append(eps, d.start())
	}
	for _, e := range eps {
		d.releaseN(e.id, turns-1)
		d.awaitHeld(e.id) // the last call, held
	}
	id := "ck-finish"
	api, node := d.api()
	done := make(chan error, 1)
	go func() {
		_, err := api.Checkpoint(d.w.ctx, client.CheckpointRequest{ID: id})
		done <- err
	}()
	ctx, cancel := context.WithTimeout(d.w.ctx, time.Minute)
	defer cancel()
	for {
		_, _, err := api.GetCheckpoint(ctx, id)
		if err == nil {
			break
		}
		if !errors.Is(err, errdefs.ErrNotFound) || ctx.Err() != nil {
			d.fatalf("checkpoint %s never appeared: %v", id, err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
	for _, e := range eps {
		d.release(e.id)
	}
	if err := <-done; err != nil {
		d.fatalf("checkpoint %s on %s: %v", id, node, err)
	}
	c := d.readCheckpoint(id)
	finished := 0
	for _, e := range eps {
		r := c.records[e.id]
		d.logf("  %s recorded %s", e.id, map[bool]string{true: "finished", false: "paused"}[r.Finished])
		if r.Finished {
			finished++
		}
	}
	if finished == 0 {
		d.fatalf("checkpoint %s recorded no episode finished: none ended while it was prepared", id)
	}
	for _, e := range eps {
		d.awaitEnded(e.id)
		vr, err := api.Verify(d.w.ctx, e.id)
		if err != nil || vr.Recorded != c.records[e.id].Finished {
			d.fatalf("verify %s after the checkpoint: %+v %v", e.id, vr, err)
		}
		d.sawVerdict(e, vr.Verdict, "verify after the checkpoint")
	}
	d.crash(1)
	d.restore(c, nil)
	for _, e := range eps {
		if r := c.records[e.id]; r.Finished {
			vr, err := api2(d).Verify(d.w.ctx, e.id)
			if err != nil || !vr.Recorded {
				d.fatalf("%s, recorded finished, verified again after the restore: %+v %v", e.id, vr, err)
			}
			d.sawVerdict(e, vr.Verdict, "verify after the restore")
		}
	}
}

// sandboxTmp is where the local provider keeps the /tmp of an episode's
// sandbox, on its node's host.
func (d *driver) sandboxTmp(v client.EpisodeView) string {
	for i, n := range d.w.nodes {
		if n != nil && n.name == v.Node {
			return filepath.Join(d.w.stateOf(i), "local", "sandboxes", "local", v.Sandbox, "root", "tmp")
		}
	}
	d.fatalf("episode %s's node %s is not up", v.ID, v.Node)
	return ""
}

// api2 is any node's API.
func api2(d *driver) *client.Client { return d.reader() }

// A verify running when a checkpoint begins is waited for: the
// checkpoint records the episode finished with that very verdict (the
// tests ran once), and a restore of it brings the episode back ended with
// it (no verify runs again). ep-slow's tests take two seconds more; the
// checkpoint is asked once the verify's run has begun in the sandbox (its
// home appears in the sandbox's /tmp, which the local provider keeps in
// the sandbox's directory on the host), and the scenario checks that the
// two overlapped.
func verifyDuringCheckpoint(d *driver) {
	other := d.start() // a running episode beside it
	e := d.startAs("ep-slow")
	d.releaseN(e.id, turns)
	d.awaitEnded(e.id)
	api, node := d.api()
	type answer struct {
		vr  client.VerifyResponse
		err error
	}
	view, err := api.Episode(d.w.ctx, e.id)
	if err != nil {
		d.fatalf("%v", err)
	}
	tmp := d.sandboxTmp(view)
	verified := make(chan answer, 1)
	go func() {
		vr, err := api.Verify(d.w.ctx, e.id)
		verified <- answer{vr, err}
	}()
	// The verify is under way once its home is in the sandbox's /tmp
	// (the tests' two seconds have begun).
	wctx, wcancel := context.WithTimeout(d.w.ctx, time.Minute)
	defer wcancel()
	for {
		if m, _ := filepath.Glob(filepath.Join(tmp, ".stasis-verify-*")); len(m) > 0 {
			break
		}
		select {
		case <-wctx.Done():
			d.fatalf("the verify of ep-slow never began its tests in %s", tmp)
		case <-time.After(5 * time.Millisecond): // poll interval, bounded by wctx
		}
	}
	c := d.checkpoint("checkpoint while ep-slow is verified")
	v := <-verified
	if v.err != nil || v.vr.Recorded {
		d.fatalf("the verify of ep-slow on %s: %+v %v", node, v.vr, v.err)
	}
	ck, _, err := api.GetCheckpoint(d.w.ctx, c.id)
	if err != nil {
		d.fatalf("%v", err)
	}
	// The verify asked of the API ran the tests (it was not answered
	// from a recorded verdict), and the checkpoint ran beside it.
	end := v.vr.Verdict.Started.Add(time.Duration(v.vr.Verdict.DurationS * float64(time.Second)))
	if ck.Committed == nil || !ck.Created.Before(end) || !ck.Committed.After(v.vr.Verdict.Started) {
		d.fatalf("the checkpoint (%s to %v) and the verify (%s to %s) did not overlap: the scenario did not happen", ck.Created, ck.Committed, v.vr.Verdict.Started, end)
	}
	r := c.records[e.id]
	if !r.Finished {
		d.fatalf("checkpoint %s recorded ep-slow, which had ended, as running", c.id)
	}
	// readCheckpoint took the record's verdict first; the verify's must
	// be the same one (the checkpoint waited for it, nothing ran twice).
	d.sawVerdict(e, v.vr.Verdict, "the verify the checkpoint waited for")
	d.logf("the checkpoint began at %+.2fs from the start of ep-slow's verify, waited for it and recorded its verdict", ck.Created.Sub(v.vr.Verdict.Started).Seconds())
	d.releaseN(other.id, 1)
	d.crash(2)
	d.restore(c, nil)
	vr, err := api2(d).Verify(d.w.ctx, e.id)
	if err != nil || !vr.Recorded {
		d.fatalf("ep-slow after the restore: %+v %v", vr, err)
	}
	d.sawVerdict(e, vr.Verdict, "verify after the restore")
	if ep, err := api2(d).Episode(d.w.ctx, e.id); err != nil || ep.State != store.EpisodeEnded {
		d.fatalf("ep-slow after the restore: %+v %v", ep, err)
	}
}

// A checkpoint with no crash, during which no response reaches any
// harness: every episode's next call is held at the model through it.
// Each record's position is what its harness had been given; no entry is
// added to any ledger while it runs; and the calls held through it are
// the same ones after it (none was issued again), each answered once
// when let through. Without a crash every episode runs once: the model
// answers exactly its script's calls (checkCalls counts them).
func quietCheckpoint(d *driver) {
	var eps []*episode
	for range 3 {
		eps = append(eps, d.start())
	}
	given := map[string]int{}
	for i, e := range eps {
		d.releaseN(e.id, i+1)
		given[e.id] = i + 1
	}
	held := map[string]model.GateCall{}
	for _, e := range eps {
		held[e.id] = d.awaitHeld(e.id)
	}
	c := d.checkpoint("checkpoint with every next call held")
	api, _ := d.api()
	for _, e := range eps {
		if p := c.positions[e.id]; p != int64(given[e.id]) {
			d.fatalf("%s had %d answers; checkpoint %s records position %d", e.id, given[e.id], c.id, p)
		}
		l, err := api.Ledger(d.w.ctx, e.id, 0, 0, false)
		if err != nil || l.Live != int64(given[e.id]) {
			d.fatalf("%s's ledger after the checkpoint: %d entries, want %d (%v)", e.id, l.Live, given[e.id], err)
		}
	}
	w := d.w.gate.Waiting()
	if len(w) != len(eps) {
		d.fatalf("after the checkpoint the model holds %v; before it %v", w, held)
	}
	for _, call := range w {
		found := false
		for _, h := range held {
			found = found || h == call
		}
		if !found {
			d.fatalf("call %+v was issued again through the checkpoint", call)
		}
	}
	for _, e := range eps {
		d.releaseN(e.id, turns-given[e.id])
	}
	if n := len(d.w.gate.Passed()); n != turns*len(eps) {
		d.fatalf("the model answered %d calls for %d episodes of %d turns, with no crash", n, len(eps), turns)
	}
}

// ledgerString is a ledger page in short: each entry's seq, call and
// attempt, the dropped ones after a bar, and the events.
func ledgerString(l client.LedgerResponse) string {
	var b strings.Builder
	for _, e := range l.Entries {
		fmt.Fprintf(&b, "%d:%s@%d ", e.Seq, e.CallID, e.Attempt)
	}
	b.WriteString("| dropped ")
	for _, e := range l.Dropped {
		fmt.Fprintf(&b, "%d:%s@%d ", e.Seq, e.CallID, e.Attempt)
	}
	b.WriteString("| events ")
	for _, ev := range l.Events {
		fmt.Fprintf(&b, "%s %d->%d (%s); ", ev.Kind, ev.From, ev.To, ev.Reason)
	}
	return b.String()
}
