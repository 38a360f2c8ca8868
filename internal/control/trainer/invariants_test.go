package trainer_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"time"

	"stasis/client"
	"stasis/internal/control/system"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

// checkInvariants checks, at the end of a sequence (after drain), every
// invariant of issue 23's random trainer sequences, each where its
// comment says:
//
//  1. every episode finished with reward 1, failing only in ways the
//     sequence caused: drain verified every running episode (reward 1,
//     verified once: sawVerdict), and checkStates holds the server's
//     states to the driver's (lost only where a crash took an episode no
//     restore brought back, retired where the sequence retired it);
//  2. no model call was made that an episode did not need: checkCalls,
//     from the calls the scripted model's gate let through;
//  3. every ledger verifies, one lineage per episode with no call of a
//     dead attempt in it: checkLedgers;
//  4. every committed checkpoint still validates and restores:
//     checkRestores;
//  5. every server, gateway and provider is idle with nothing left (no
//     episodes, sessions, sandboxes, held calls): checkIdle.
func (d *driver) checkInvariants() {
	d.w.t.Helper()
	d.n = 0 // failures below name no operation
	d.checkStates()
	d.checkCalls()
	d.checkLedgers()
	d.checkRestores()
	d.checkIdle()
}

// checkStates (invariant 1): what the server says of each episode is what
// the sequence made of it.
func (d *driver) checkStates() {
	api, _ := d.api()
	views, err := api.Episodes(d.w.ctx, client.ListOptions{})
	if err != nil {
		d.fatalf("list the episodes: %v", err)
	}
	if len(views) != len(d.episodes) {
		d.fatalf("the server has %d episodes, the sequence started %d", len(views), len(d.episodes))
	}
	for _, v := range views {
		e, ok := d.episodes[v.ID]
		if !ok {
			d.fatalf("the server has episode %s, which the sequence never started", v.ID)
		}
		switch e.state {
		case stEnded:
			// Asked of the node that drives it (the list's view is the
			// answering node's).
			one, err := api.Episode(d.w.ctx, v.ID)
			if err != nil || one.State != store.EpisodeEnded || one.Live == e.gone || one.Reward == nil || *one.Reward != 1 || one.Attempt != e.attempt {
				d.fatalf("%s should have ended with reward 1 at attempt %d: %+v %v", v.ID, e.attempt, one, err)
			}
		case stRetired:
			if v.State != store.EpisodeRetired {
				d.fatalf("%s should be retired: %s", v.ID, v.State)
			}
		case stLost:
			// Lost, or still running in the store on a node that did
			// not come back (no node drives it: nothing runs it).
			if v.State != store.EpisodeLost && !d.orphaned(v) {
				d.fatalf("%s should be lost (a crash took it, and no restore brought it back): %s on %s", v.ID, v.State, v.Node)
			}
		default:
			d.fatalf("%s is %s at the end of the sequence", v.ID, e.state)
		}
	}
}

// orphaned says whether an episode's row names a node that is down.
func (d *driver) orphaned(v client.EpisodeView) bool {
	return (v.State == store.EpisodeRunning || v.State == store.EpisodeEnded) &&
		!slices.ContainsFunc(d.w.up(), func(n *node) bool { return n.name == v.Node })
}

// checkCalls (invariant 2): the scripted model answered no call that an
// episode did not need. Each call the gate let through belongs to a run
// of its episode (the last begun before the call was let through): a run
// asks each turn once, from the turn after its start's recorded position
// on, so no call whose response a harness had been given before a
// checkpoint is asked again after its restore. Summed: the model's calls
// are at most what the runs' scripts need.
func (d *driver) checkCalls() {
	passed := d.w.gate.Passed()
	byTask := map[string]*episode{}
	need := 0
	for _, e := range d.episodes {
		byTask[e.task] = e
		for _, r := range e.runs {
			need += turns - r.start
		}
	}
	seen := map[string]map[int]bool{} // episode/run → turns asked
	for i, c := range passed {
		e, ok := byTask[c.Script]
		if !ok {
			d.fatalf("the model answered a call of script %q, which no episode plays", c.Script)
		}
		k := -1
		for j, r := range e.runs {
			if r.from <= i {
				k = j
			}
		}
		if k < 0 {
			d.fatalf("the model answered %s's turn %d before the episode was started", e.id, c.Turn)
		}
		r := e.runs[k]
		key := fmt.Sprintf("%s/%d", e.id, k)
		if seen[key] == nil {
			seen[key] = map[int]bool{}
		}
		switch {
		case c.Turn < r.start:
			d.fatalf("%s's turn %d was asked of the model again in its %s, which starts at turn %d: a call whose response its harness had was repeated", e.id, c.Turn, r.why, r.start)
		case c.Turn >= turns:
			d.fatalf("%s asked for turn %d, past its script's %d", e.id, c.Turn, turns)
		case seen[key][c.Turn]:
			d.fatalf("%s's turn %d was asked of the model twice in its %s", e.id, c.Turn, r.why)
		}
		seen[key][c.Turn] = true
	}
	if len(passed) > need {
		d.fatalf("the model answered %d calls; the episodes' runs need at most %d", len(passed), need)
	}
	d.logf("invariant: the model answered %d calls, the runs needed at most %d", len(passed), need)
}

// checkLedgers (invariant 3): every ledger verifies; its live entries are
// one lineage: seq 1, 2, … with each entry made by the attempt the
// episode's history (starts, restarts, restores) says, so none of a dead
// attempt; an episode that ended has every turn, each asked once in
// order and delivered.
func (d *driver) checkLedgers() {
	api, _ := d.api()
	for _, id := range d.ids(nil) {
		e := d.episodes[id]
		rep, err := api.VerifyLedger(d.w.ctx, id)
		if err != nil || !rep.OK || rep.Broken {
			d.fatalf("%s's ledger does not verify: %+v %v", id, rep, err)
		}
		l, err := api.Ledger(d.w.ctx, id, 0, 0, true)
		if err != nil {
			d.fatalf("%s's ledger: %v", id, err)
		}
		if e.state == stEnded && len(l.Entries) != turns {
			d.fatalf("%s ended with %d entries in its ledger, not %d", id, len(l.Entries), turns)
		}
		for i, en := range l.Entries {
			seq := int64(i + 1)
			if en.Seq != seq {
				d.fatalf("%s's ledger: entry %d has seq %d", id, i, en.Seq)
			}
			if want := attemptAt(e.lineage, seq); en.Attempt != want {
				d.fatalf("%s's ledger: entry %d (%s) is of attempt %d; its lineage %v says %d: a call of a dead attempt is in it", id, seq, en.CallID, en.Attempt, e.lineage, want)
			}
			if n := assistantMessages(en.Request); n != i {
				d.fatalf("%s's ledger: entry %d asks for turn %d, not %d", id, seq, n, i)
			}
			if e.state == stEnded && en.Disposition != ledger.Delivered {
				d.fatalf("%s's ledger: entry %d is %s, not delivered", id, seq, en.Disposition)
			}
		}
	}
	d.logf("invariant: every ledger verifies, one lineage each")
}

// attemptAt is the attempt whose entry seq is, by lineage l.
func attemptAt(l []piece, seq int64) int {
	a := -1
	for _, p := range l {
		if p.From <= seq {
			a = p.Attempt
		}
	}
	return a
}

// assistantMessages counts the assistant messages of a chat request.
func assistantMessages(req json.RawMessage) int {
	var r struct {
		Messages []struct {
			Role string `json:"role"`
		} `json:"messages"`
	}
	if json.Unmarshal(req, &r) != nil {
		return -1
	}
	n := 0
	for _, m := range r.Messages {
		if m.Role == "assistant" {
			n++
		}
	}
	return n
}

// retireAll retires every episode that is not retired, each through a
// node (the one that drives it, by forwarding).
func (d *driver) retireAll() {
	for _, id := range d.ids(func(e *episode) bool { return e.state != stRetired }) {
		api, node := d.api()
		if v, err := api.Retire(d.w.ctx, id); err != nil || v.State != store.EpisodeRetired {
			d.fatalf("retire %s on %s: %v", id, node, err)
		}
		d.episodes[id].state = stRetired
	}
}

// checkRestores (invariant 4): every committed checkpoint still
// validates and restores: each, oldest first, brings back every episode
// it recorded (named, since all are retired first), which is then
// retired again. The model's gate is closed: the restored harnesses make
// no call.
func (d *driver) checkRestores() {
	api, _ := d.api()
	cks, err := api.Checkpoints(d.w.ctx, "", 0)
	if err != nil {
		d.fatalf("list the checkpoints: %v", err)
	}
	committed := 0
	for _, ck := range cks {
		switch {
		case ck.State == store.StatePending:
			d.fatalf("checkpoint %s is still pending", ck.ID)
		case ck.State == store.StateCommitted:
			committed++
		}
	}
	if committed != len(d.ckpts) {
		d.fatalf("the server has %d committed checkpoints, the sequence took %d", committed, len(d.ckpts))
	}
	for _, c := range d.ckpts {
		d.retireAll()
		if len(c.records) == 0 {
			continue
		}
		var names []string
		for ep := range c.records {
			names = append(names, ep)
		}
		slices.Sort(names)
		d.restore(c, names)
		d.logf("invariant: checkpoint %s restores", c.id)
	}
	d.retireAll()
}

// checkIdle (invariant 5): every node, gateway and provider is idle with
// nothing left: no live episode on any node, no pending checkpoint, no
// call held at the model; stopped, the nodes leave no sandbox, no
// gateway socket and no process.
func (d *driver) checkIdle() {
	for _, n := range d.w.up() {
		b, err := get(n.url + "/metrics")
		if err != nil || !bytes.Contains(b, []byte("\nstasis_server_live_episodes 0\n")) {
			d.fatalf("%s drives episodes still (or its metrics did not answer: %v)", n.name, err)
		}
		views, err := n.api.Episodes(d.w.ctx, client.ListOptions{})
		if err != nil {
			d.fatalf("%s: list the episodes: %v", n.name, err)
		}
		for _, v := range views {
			if v.Live || v.State != store.EpisodeRetired {
				d.fatalf("%s: episode %s is %s (live %v) after every one was retired", n.name, v.ID, v.State, v.Live)
			}
		}
	}
	testwait.Until(d.w.t, "the model holds no call", time.Minute, func() bool { return len(d.w.gate.Waiting()) == 0 })
	d.w.stopNodes()
	for i := range maxNodes {
		state := d.w.stateOf(i)
		if _, err := os.Stat(state); err != nil {
			continue // never up
		}
		p, err := local.New(local.Options{Home: filepath.Join(state, "local"), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
		if err != nil {
			d.fatalf("node-%d's provider: %v", i+1, err)
		}
		left, err := p.List(d.w.ctx, nil)
		if err != nil || len(left) > 0 {
			d.fatalf("node-%d left sandboxes: %+v %v", i+1, left, err)
		}
		// A node a crash killed leaves its socket directory (teardown
		// removes it, as an operator would); one stopped removes it.
		if sock, err := system.GatewaySocket(state); err == nil && d.w.stopped[i] {
			if _, err := os.Stat(filepath.Dir(sock)); err == nil {
				d.fatalf("node-%d left its gateway's socket directory %s", i+1, filepath.Dir(sock))
			}
		}
	}
	d.logf("invariant: idle, nothing left")
}

func get(url string) ([]byte, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return io.ReadAll(resp.Body)
}
