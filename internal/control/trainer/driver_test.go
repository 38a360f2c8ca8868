package trainer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	"stasis/client"
	"stasis/errdefs"
	"stasis/internal/control/model"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/store"
)

// What the driver expects of an episode.
type epState string

const (
	stRunning epState = "running" // its harness runs (or has ended, not yet seen)
	stEnded   epState = "ended"   // its harness ended; its sandbox stays for verify
	stRetired epState = "retired"
	stLost    epState = "lost" // a crash took it and no restore brought it back
)

// episode is the driver's model of one episode: what the server should
// say of it, and what its calls and its ledger may be.
type episode struct {
	id, task string
	state    epState
	attempt  int
	// done: its last call was let through, so its harness ends by itself.
	done bool
	// gone: it has no sandbox (it came back ended from a checkpoint that
	// recorded it finished): no checkpoint holds it from then on.
	gone bool
	// runs are its runs since its start, for the count of the model's
	// calls: each call the model answers for the episode belongs to the
	// run begun last before the call was let through.
	runs []run
	// lineage is what its logical ledger must be made of: each piece's
	// attempt made the entries from its seq on, up to the next piece.
	lineage []piece
	// verdict is its verdict as first seen (a restore of a checkpoint
	// that recorded it finished must give this one, not verify again).
	verdict *task.Verdict
}

// run is one run of an episode's harness: from a start (turn 0) or a
// restore (the turn after the recorded position).
type run struct {
	why string
	// from is how many calls the model had let through (all episodes')
	// when the run began; start is the first turn it may ask.
	from, start int
}

// piece is one attempt's part of a ledger: entries from seq From on.
type piece struct {
	Attempt int
	From    int64
}

// ckpt is the driver's model of a committed checkpoint.
type ckpt struct {
	id      string
	records map[string]store.Record
	// lineage is each recorded episode's lineage at the checkpoint, up
	// to its position.
	lineage map[string][]piece
	// positions are the ledger positions its harnesses resume from.
	positions map[string]int64
}

// position is where a record leaves its episode's ledger.
func position(r store.Record) int64 {
	switch {
	case r.RelayPosition != nil:
		return *r.RelayPosition
	case r.RelayDelivered != nil:
		return *r.RelayDelivered
	}
	return 0
}

// positionOf is where record r leaves episode e's harness in its ledger:
// the record's position, or, when its relay had not learned its place
// yet (relaunched by a restore, no call answered since: the record says
// 0), where the run the restore began starts.
func (d *driver) positionOf(e *episode, r store.Record) int64 {
	p := position(r)
	if n := len(e.runs); n > 0 && int64(e.runs[n-1].start) > p {
		d.logf("  %s's record in a checkpoint says position %d; its run began at %d (a relaunched relay that has had no answer yet)", e.id, p, e.runs[n-1].start)
		if !r.RelayUnmatched {
			d.fatalf("%s's record says position %d, yet its harness resumed at %d, and the record does not say its relay did not know its place (relay_unmatched)", e.id, p, e.runs[n-1].start)
		}
		d.ops["records of an unmatched relay"]++
		p = int64(e.runs[n-1].start)
	}
	return p
}

// upTo is a lineage cut to its first n entries.
func upTo(l []piece, n int64) []piece {
	var out []piece
	for _, p := range l {
		if p.From <= n {
			out = append(out, p)
		}
	}
	return out
}

// driver drives one sequence: it chooses the operations from its seed and
// keeps the model the invariants are checked against.
type driver struct {
	w        *world
	rng      *rand.Rand
	seed     uint64
	episodes map[string]*episode
	ckpts    []*ckpt // committed, oldest first
	n        int     // operations done
	nextEp   int     // ids given
	maxEps   int
	crashes  int
	// ops counts the operations done, by name.
	ops map[string]int
}

func newDriver(w *world, seed uint64, maxEps int) *driver {
	return &driver{w: w, rng: rand.New(rand.NewPCG(seed, 0x5eed)), seed: seed, episodes: map[string]*episode{}, maxEps: maxEps, ops: map[string]int{}}
}

func (d *driver) logf(format string, args ...any) { d.w.log.add(format, args...) }

// fatalf fails the sequence, naming the operation.
func (d *driver) fatalf(format string, args ...any) {
	d.w.t.Helper()
	d.w.t.Fatalf("operation %d: %s", d.n, fmt.Sprintf(format, args...))
}

// api is a node's API: one the rng picks.
func (d *driver) api() (*client.Client, string) {
	up := d.w.up()
	n := up[d.rng.IntN(len(up))]
	return n.api, n.name
}

// reader is a node's API for the reads a wait repeats, as often as
// timing has it: the first node up, so that the rng (which picks the
// operations' nodes) is drawn the same number of times in every replay of
// a seed.
func (d *driver) reader() *client.Client { return d.w.up()[0].api }

// ids lists the episodes in id order (the rng picks from lists in a
// fixed order, so that a seed replays its choices).
func (d *driver) ids(keep func(*episode) bool) []string {
	var out []string
	for id, e := range d.episodes {
		if keep == nil || keep(e) {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

func (d *driver) pick(ids []string) string { return ids[d.rng.IntN(len(ids))] }

// passed is how many calls the model has let through so far.
func (d *driver) passed() int { return len(d.w.gate.Passed()) }

// ---- operations ----

// start starts a new episode on a node.
func (d *driver) start() *episode {
	d.nextEp++
	return d.startAs(fmt.Sprintf("ep-%d", d.nextEp))
}

// startAs starts episode id (its task is taskOf's) on a node.
func (d *driver) startAs(id string) *episode {
	api, node := d.api()
	e := &episode{id: id, task: taskOf(id)}
	v, err := api.StartEpisode(d.w.ctx, client.StartRequest{ID: id, Task: e.task, Harness: "mini"})
	if err != nil {
		d.fatalf("start %s on %s: %v", id, node, err)
	}
	d.started(e, v, "start")
	d.logf("start %s on %s (attempt %d)", id, node, v.Attempt)
	return e
}

// started records an episode's start (or restart) as the server answered it.
func (d *driver) started(e *episode, v client.EpisodeView, why string) {
	if v.State != store.EpisodeRunning || !v.Live {
		d.fatalf("%s %s: the answer says %s, live %v", why, e.id, v.State, v.Live)
	}
	e.state, e.attempt, e.done, e.gone, e.verdict = stRunning, v.Attempt, false, false, nil
	e.runs = append(e.runs, run{why: fmt.Sprintf("%s as attempt %d", why, v.Attempt), from: d.passed(), start: 0})
	e.lineage = []piece{{Attempt: v.Attempt, From: 1}}
	d.episodes[e.id] = e
}

// running lists the episodes whose harness runs and has calls to make.
func (d *driver) running() []string {
	return d.ids(func(e *episode) bool { return e.state == stRunning && !e.done })
}

// release lets through the next call of episode id, once the model holds
// it; an episode whose harness turns out to have ended (it was relaunched
// from a session that had its last answer) is marked so.
func (d *driver) release(id string) {
	e := d.episodes[id]
	ctx, cancel := context.WithTimeout(d.w.ctx, 2*time.Minute)
	defer cancel()
	for {
		if out := d.w.gate.Release(1, func(c model.GateCall) bool { return c.Script == e.task }); len(out) == 1 {
			if out[0].Turn == turns-1 {
				e.done = true
			}
			d.logf("  let %s's turn %d through", id, out[0].Turn)
			return
		}
		// Not there yet: wait for a call, or look whether its harness
		// has ended.
		wctx, wcancel := context.WithTimeout(ctx, time.Second)
		_ = d.w.gate.Await(wctx, func(w []model.GateCall) bool {
			return slices.ContainsFunc(w, func(c model.GateCall) bool { return c.Script == e.task })
		})
		wcancel()
		if ctx.Err() != nil {
			d.fatalf("%s's next model call never came (%s)", id, d.describe(id))
		}
		if !slices.ContainsFunc(d.w.gate.Waiting(), func(c model.GateCall) bool { return c.Script == e.task }) {
			if d.harnessEnded(id) {
				e.done = true
				d.logf("  %s's harness had ended", id)
				return
			}
		}
	}
}

// awaitEnded waits until episode id's harness has ended.
func (d *driver) awaitEnded(id string) {
	ctx, cancel := context.WithTimeout(d.w.ctx, 3*time.Minute)
	defer cancel()
	for !d.harnessEnded(id) {
		select {
		case <-ctx.Done():
			d.fatalf("%s did not end (%s)", id, d.describe(id))
		case <-time.After(100 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
}

// harnessEnded asks whether an episode's harness has ended.
func (d *driver) harnessEnded(id string) bool {
	v, err := d.reader().Episode(d.w.ctx, id)
	if err != nil {
		return false
	}
	return v.State == store.EpisodeEnded || (v.Status != nil && v.Status.State == supervisor.StateExited)
}

func (d *driver) describe(id string) string {
	v, err := d.reader().Episode(d.w.ctx, id)
	if err != nil {
		return err.Error()
	}
	b, _ := json.Marshal(v)
	return string(b) + "; the model holds " + fmt.Sprint(d.w.gate.Waiting())
}

// awaitHeld waits until the model holds a call of episode id.
func (d *driver) awaitHeld(id string) model.GateCall {
	e := d.episodes[id]
	ctx, cancel := context.WithTimeout(d.w.ctx, 2*time.Minute)
	defer cancel()
	var got model.GateCall
	err := d.w.gate.Await(ctx, func(w []model.GateCall) bool {
		for _, c := range w {
			if c.Script == e.task {
				got = c
				return true
			}
		}
		return false
	})
	if err != nil {
		d.fatalf("%s's next model call never came (%s)", id, d.describe(id))
	}
	return got
}

// opRelease lets one to three calls through, each of an episode the rng
// picks.
func (d *driver) opRelease() {
	n := 1 + d.rng.IntN(3)
	for range n {
		ids := d.running()
		if len(ids) == 0 {
			return
		}
		d.release(d.pick(ids))
	}
}

// opContinue lets every running episode make its next call.
func (d *driver) opContinue() {
	ids := d.running()
	d.logf("continue %v", ids)
	for _, id := range ids {
		d.release(id)
	}
}

// checkpoint takes a checkpoint on a node the rng picks and reads its
// records; live are the episodes it must hold (whose start was answered
// before it was asked for).
func (d *driver) checkpoint(why string) *ckpt {
	id := fmt.Sprintf("ck-%d-%d", d.seed, len(d.ckpts)+1)
	api, node := d.api()
	live := d.ids(func(e *episode) bool { return (e.state == stRunning || e.state == stEnded) && !e.gone })
	res, err := api.Checkpoint(d.w.ctx, client.CheckpointRequest{ID: id})
	if err != nil {
		d.fatalf("%s: checkpoint %s on %s: %v", why, id, node, err)
	}
	if res.ContinueError != "" {
		d.fatalf("checkpoint %s: committed, but an episode was not continued: %s", id, res.ContinueError)
	}
	for _, f := range res.Episodes {
		if f.Excluded {
			d.fatalf("checkpoint %s left out %s: %s", id, f.Episode, f.Reason)
		}
	}
	c := d.readCheckpoint(id)
	for _, ep := range live {
		if _, ok := c.records[ep]; !ok {
			d.fatalf("checkpoint %s has no record of %s, whose start was answered before it was asked for", id, ep)
		}
	}
	d.logf("%s: checkpoint %s on %s: %d records %s", why, id, node, len(c.records), c.describe())
	return c
}

// readCheckpoint reads a committed checkpoint's records and keeps the
// lineage of each of its episodes then.
func (d *driver) readCheckpoint(id string) *ckpt {
	api, _ := d.api()
	ck, recs, err := api.GetCheckpoint(d.w.ctx, id)
	if err != nil || ck.State != store.StateCommitted {
		d.fatalf("checkpoint %s: %+v %v", id, ck, err)
	}
	c := &ckpt{id: id, records: map[string]store.Record{}, lineage: map[string][]piece{}, positions: map[string]int64{}}
	for _, r := range recs {
		e, ok := d.episodes[r.Episode]
		if !ok {
			d.fatalf("checkpoint %s has a record of %s, which the sequence never started", id, r.Episode)
		}
		if r.Attempt != e.attempt {
			d.fatalf("checkpoint %s recorded %s at attempt %d; it runs attempt %d", id, r.Episode, r.Attempt, e.attempt)
		}
		c.records[r.Episode] = r
		if r.Finished {
			c.lineage[r.Episode] = slices.Clone(e.lineage)
			var v task.Verdict
			if err := json.Unmarshal(r.Result, &v); err != nil || v.Reward != 1 {
				d.fatalf("checkpoint %s recorded %s finished with %s", id, r.Episode, r.Result)
			}
			d.sawVerdict(e, v, "checkpoint "+id)
			continue
		}
		c.positions[r.Episode] = d.positionOf(e, r)
		c.lineage[r.Episode] = upTo(e.lineage, c.positions[r.Episode])
	}
	d.ckpts = append(d.ckpts, c)
	return c
}

// sawVerdict checks a verdict of an episode against the first one seen of
// its attempt: verify runs once per attempt (capture once), whoever asks.
func (d *driver) sawVerdict(e *episode, v task.Verdict, where string) {
	if v.Attempt != e.attempt {
		d.fatalf("%s: %s's verdict is of attempt %d, it runs %d", where, e.id, v.Attempt, e.attempt)
	}
	if e.verdict == nil {
		e.verdict = &v
		if e.state == stRunning {
			e.state, e.done = stEnded, true
		}
		return
	}
	if !e.verdict.Started.Equal(v.Started) {
		d.fatalf("%s: %s (attempt %d) was verified twice: at %s and at %s", where, e.id, e.attempt, e.verdict.Started, v.Started)
	}
}

func (c *ckpt) describe() string {
	var parts []string
	for _, ep := range slices.Sorted(func(yield func(string) bool) {
		for k := range c.records {
			if !yield(k) {
				return
			}
		}
	}) {
		r := c.records[ep]
		if r.Finished {
			parts = append(parts, ep+"=finished")
		} else {
			parts = append(parts, fmt.Sprintf("%s@%d", ep, c.positions[ep]))
		}
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// opStartThenCheckpoint starts one or two episodes and checkpoints right
// after: they are in it.
func (d *driver) opStartThenCheckpoint() {
	n := min(1+d.rng.IntN(2), d.maxEps-d.nextEp)
	for range n {
		d.start()
	}
	d.checkpoint("right after starting")
}

// opStartDuringCheckpoint asks a node for a start while a checkpoint runs
// (once the checkpoint is open, or, half the time, asks for the checkpoint
// right after the start, while it is under way): a start asked while the
// node takes its share of a checkpoint is admitted after it, and a share
// waits for the starts under way; so the episode is in the checkpoint,
// whole, or not at all.
func (d *driver) opStartDuringCheckpoint() {
	if d.rng.IntN(2) == 0 {
		d.ops["checkpoint during start"]++
		d.opCheckpointDuringStart()
		return
	}
	id := fmt.Sprintf("ck-%d-%d", d.seed, len(d.ckpts)+1)
	api, node := d.api()
	live := d.ids(func(e *episode) bool { return (e.state == stRunning || e.state == stEnded) && !e.gone })
	type answer struct {
		res client.CheckpointResponse
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := api.Checkpoint(d.w.ctx, client.CheckpointRequest{ID: id})
		done <- answer{res, err}
	}()
	// The checkpoint is open once the store has it.
	ctx, cancel := context.WithTimeout(d.w.ctx, time.Minute)
	defer cancel()
	for {
		if _, _, err := api.GetCheckpoint(ctx, id); err == nil {
			break
		} else if !errors.Is(err, errdefs.ErrNotFound) || ctx.Err() != nil {
			d.fatalf("checkpoint %s never appeared: %v", id, err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
	e := d.start()
	a := <-done
	if a.err != nil {
		d.fatalf("checkpoint %s on %s with a start beside it: %v", id, node, a.err)
	}
	c := d.readCheckpoint(id)
	for _, ep := range live {
		if _, ok := c.records[ep]; !ok {
			d.fatalf("checkpoint %s has no record of %s, whose start was answered before it was asked for", id, ep)
		}
	}
	// Each node admits a start after its own share of a checkpoint: one
	// asked before the node's share began is in it, whole.
	_, in := c.records[e.id]
	d.logf("start %s during checkpoint %s on %s: %d records %s (%s in it: %v)", e.id, id, node, len(c.records), c.describe(), e.id, in)
}

// opCheckpointDuringStart asks a node for a checkpoint right after asking
// one for a start, while the start is under way.
func (d *driver) opCheckpointDuringStart() {
	d.nextEp++
	e := &episode{id: fmt.Sprintf("ep-%d", d.nextEp)}
	e.task = taskOf(e.id)
	d.episodes[e.id] = e // starting: in the checkpoint or not, at attempt 0
	api, node := d.api()
	live := d.ids(func(e *episode) bool { return (e.state == stRunning || e.state == stEnded) && !e.gone })
	type answer struct {
		v   client.EpisodeView
		err error
	}
	started := make(chan answer, 1)
	go func() {
		v, err := api.StartEpisode(d.w.ctx, client.StartRequest{ID: e.id, Task: e.task, Harness: "mini"})
		started <- answer{v, err}
	}()
	// The checkpoint is asked without waiting for the start: it finds
	// it under way (waited for), or not begun yet (admitted after it).
	c := d.checkpoint("checkpoint while " + e.id + " starts")
	a := <-started
	if a.err != nil {
		d.fatalf("start %s on %s beside checkpoint %s: %v", e.id, node, c.id, a.err)
	}
	d.started(e, a.v, "start")
	_, in := c.records[e.id]
	for _, ep := range live {
		if _, ok := c.records[ep]; !ok {
			d.fatalf("checkpoint %s has no record of %s, whose start was answered before it was asked for", c.id, ep)
		}
	}
	d.logf("start %s on %s under way as checkpoint %s was asked: in it %v", e.id, node, c.id, in)
}

// opRestart retires an episode the rng picks (unless a crash lost it) and
// starts it again as its next attempt.
func (d *driver) opRestart() {
	d.opRestartOf(d.pick(d.ids(nil)))
}

// opRestartOf retires episode id (unless a crash lost it) and starts it
// again as its next attempt.
func (d *driver) opRestartOf(id string) {
	e := d.episodes[id]
	api, node := d.api()
	// A lost episode the server says is lost is started again as it is
	// (half the time); anything else is retired first (one that a node
	// which did not come back drove is still running in the store).
	direct := false
	if e.state == stLost {
		v, err := api.Episode(d.w.ctx, id)
		direct = err == nil && v.State == store.EpisodeLost && d.rng.IntN(2) == 0
	}
	if e.state != stRetired && !direct {
		v, err := api.Retire(d.w.ctx, id)
		if err != nil || v.State != store.EpisodeRetired {
			d.fatalf("retire %s on %s: %+v %v", id, node, v.State, err)
		}
		e.state = stRetired
	}
	before := e.attempt
	api, node = d.api()
	v, err := api.StartEpisode(d.w.ctx, client.StartRequest{ID: id, Task: e.task, Harness: "mini"})
	if err != nil {
		d.fatalf("start %s again on %s: %v", id, node, err)
	}
	if v.Attempt <= before {
		d.fatalf("%s started again as attempt %d, not after its attempt %d", id, v.Attempt, before)
	}
	d.started(e, v, "restart")
	d.logf("retire %s and start it again on %s: attempt %d", id, node, v.Attempt)
}

// opCrash kills everything and restores the latest committed checkpoint,
// on the same number of nodes or (half the time) on another.
func (d *driver) opCrash() {
	after := len(d.w.up())
	if d.rng.IntN(2) == 0 {
		after = 1 + d.rng.IntN(maxNodes)
	}
	d.crash(after)
	d.restoreLatest()
}

// crash kills every node and sandbox, and starts nodes node-1 … node-n
// again; once the dead nodes' leases have run out, the model is as a
// crash leaves it: a restore is next.
func (d *driver) crash(n int) {
	d.crashes++
	before := len(d.w.up())
	d.w.crash()
	d.w.startNodes(n)
	d.w.awaitLeases()
	d.logf("crash of %d nodes and every sandbox; %d nodes up again", before, n)
}

// restoreLatest restores the latest committed checkpoint after a crash
// (or, with none, finds every episode lost) and updates the model.
func (d *driver) restoreLatest() {
	for _, e := range d.episodes {
		switch {
		case e.state == stEnded && e.verdict != nil:
			e.gone = true // its verdict was captured: it stays ended, without its sandbox
		case e.state == stRunning || e.state == stEnded:
			e.state = stLost
		}
	}
	if len(d.ckpts) == 0 {
		d.logf("  no checkpoint to restore: every episode is lost")
		return
	}
	d.restore(d.ckpts[len(d.ckpts)-1], nil)
}

// restore restores checkpoint c (names: only those episodes) on a node the
// rng picks, and updates the model: every episode of c not retired (or
// named) comes back as its next attempt, running or, recorded finished,
// ended with its verdict.
func (d *driver) restore(c *ckpt, names []string) {
	api, node := d.api()
	var res client.RestoreResponse
	var err error
	if names == nil {
		res, err = api.Restore(d.w.ctx, c.id)
	} else {
		res, err = api.RestoreWith(d.w.ctx, c.id, client.RestoreRequest{Episodes: names})
	}
	if err != nil {
		d.fatalf("restore %s on %s: %v", c.id, node, err)
	}
	back := []string{}
	for _, ep := range d.ids(nil) {
		r, in := c.records[ep]
		e := d.episodes[ep]
		if !in || (names == nil && e.state == stRetired) || (names != nil && !slices.Contains(names, ep)) {
			continue
		}
		back = append(back, ep)
		v, err := api.Episode(d.w.ctx, ep)
		if err != nil {
			d.fatalf("%s after the restore of %s: %v", ep, c.id, err)
		}
		if r.Finished {
			if v.State != store.EpisodeEnded {
				d.fatalf("%s, recorded finished in %s, is %s after its restore", ep, c.id, v.State)
			}
			var vd task.Verdict
			_ = json.Unmarshal(r.Result, &vd)
			e.state, e.done, e.gone, e.attempt, e.verdict = stEnded, true, true, r.Attempt, &vd
			e.lineage = slices.Clone(c.lineage[ep])
			continue
		}
		if (v.State != store.EpisodeRunning && v.State != store.EpisodeEnded) || !v.Live || v.Attempt <= e.attempt {
			d.fatalf("%s after the restore of %s: %s (live %v) at attempt %d; it was at %d", ep, c.id, v.State, v.Live, v.Attempt, e.attempt)
		}
		p := c.positions[ep]
		e.state, e.done, e.gone, e.attempt, e.verdict = stRunning, false, false, v.Attempt, nil
		e.runs = append(e.runs, run{why: fmt.Sprintf("restore of %s as attempt %d", c.id, v.Attempt), from: d.passed(), start: int(p)})
		e.lineage = append(slices.Clone(c.lineage[ep]), piece{Attempt: v.Attempt, From: p + 1})
	}
	d.ops["restores"]++
	d.logf("  restore %s on %s: %v back (%d shares)", c.id, node, back, len(res.Shares))
}

// ---- the sequence ----

// runSequence runs n operations the rng picks, then drains: every call
// let through, every running episode to its end and verified.
func (d *driver) runSequence(n int) {
	type op struct {
		name   string
		weight int
		can    func() bool
		do     func()
	}
	room := func() bool { return d.nextEp < d.maxEps }
	ops := []op{
		{"start", 14, room, func() { d.start() }},
		{"release", 30, func() bool { return len(d.running()) > 0 }, d.opRelease},
		{"continue", 8, func() bool { return len(d.running()) > 1 }, d.opContinue},
		{"checkpoint", 12, func() bool { return true }, func() { d.checkpoint("checkpoint") }},
		{"start+checkpoint", 6, room, d.opStartThenCheckpoint},
		{"start during checkpoint", 6, room, d.opStartDuringCheckpoint},
		{"crash", 7, func() bool { return d.crashes < 2 }, d.opCrash},
		{"restart", 7, func() bool { return len(d.episodes) > 0 }, d.opRestart},
	}
	if d.nextEp == 0 {
		d.start()
	}
	for d.n = 1; d.n <= n; d.n++ {
		var can []op
		total := 0
		for _, o := range ops {
			if o.can() {
				can = append(can, o)
				total += o.weight
			}
		}
		x := d.rng.IntN(total)
		for _, o := range can {
			if x < o.weight {
				d.logf("op %d: %s", d.n, o.name)
				d.ops[o.name]++
				o.do()
				break
			}
			x -= o.weight
		}
	}
	if up := len(d.w.up()); up < maxNodes {
		d.w.recoverNodes()
		if len(d.w.up()) > up {
			d.logf("the nodes a crash took come back: %d up", len(d.w.up()))
			for _, e := range d.episodes {
				if e.state == stLost {
					d.logf("  %s stays lost", e.id)
				}
			}
		}
	}
	d.drain()
}

// drain lets every call through and waits for every running episode to
// end, then verifies each (reward 1).
func (d *driver) drain() {
	d.logf("drain: every call let through")
	d.w.gate.Open()
	for _, id := range d.ids(func(e *episode) bool { return e.state == stRunning || e.state == stEnded }) {
		e := d.episodes[id]
		if !e.gone {
			d.awaitEnded(id)
		}
		api, _ := d.api()
		vr, err := api.Verify(d.w.ctx, id)
		if err != nil {
			d.fatalf("verify %s: %v", id, err)
		}
		if vr.Verdict.Reward != 1 {
			d.fatalf("%s (attempt %d) ended unresolved: %s %s\n%s", id, e.attempt, vr.Verdict.Status, vr.Verdict.Reason, vr.Verdict.Output)
		}
		e.state, e.done = stEnded, true
		d.sawVerdict(e, vr.Verdict, "verify")
		d.logf("  %s ended, attempt %d, reward 1", id, e.attempt)
	}
	d.w.gate.Close()
}
