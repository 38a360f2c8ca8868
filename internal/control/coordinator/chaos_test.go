package coordinator_test

// The randomised invariants test of the coordinator.
//
// A chaos provider wraps the local one and fails Create, Exec, Snapshot,
// Fork, Delete and DeleteSnapshot at a configured rate (0, 10% and 25%),
// deterministically from a seed (a PCG stream per operation and episode).
// Its errors look like a provider's own (errdefs.ErrUnsupported, or a plain
// connection error); a failed Create, Snapshot, Fork or Delete did nothing,
// a failed Exec either did not run or ran and lost its answer. The faults
// are transient: one operation on one target fails at most 3 times in a
// row. Each seed plays a random sequence of steps: episodes started (most
// held at a model call), calls released, prepares, crashes (every sandbox
// deleted or its keeper killed, or a restart that keeps them; coordinator,
// gateway and store dropped and opened again from disk), restores of
// random committed checkpoints (after retiring their live episodes, or
// expecting the refusal), retires, verifies and checkpoint deletions. A
// step that faults made fail is expected; after every step, and at the
// end, the invariants are checked:
//
//   - no sandbox leaked: every sandbox the provider lists belongs to a live
//     episode, and every live episode's sandbox is listed;
//   - none deleted twice: the chaos provider counts the Delete (and
//     DeleteSnapshot) calls that reached the provider, per id;
//   - every snapshot that exists is named by a committed checkpoint, and
//     every committed checkpoint's snapshots exist, its records unchanged
//     (a failed prepare leaves the earlier ones intact);
//   - a prepare leaves no episode paused; a failed one leaves its
//     checkpoint failed and none of its snapshots;
//   - a committed checkpoint none of whose episodes is live restores
//     unless a fault was injected, and one with a live episode is refused
//     naming it;
//   - a committed checkpoint restores byte for byte: the work tree (/work)
//     and the harness's directory of every fork a restore makes equal what
//     was there at the pause (captured by the chaos provider right after
//     the snapshot, while the harness was stopped), and at the end every
//     committed checkpoint's snapshots fork byte for byte;
//   - ledgers: at every pause the harness's conversation is exactly the
//     ledger's first k responses (k ≤ relay_delivered ≤ k+1); after a
//     restore the ledger is that recorded prefix, byte for byte, then the
//     relaunched attempt's entries, the first one a boundary. (Known
//     limitation, logged: once a restore of an earlier checkpoint has cut
//     the ledger below a later checkpoint's position, the later one's
//     entries are not in the ledger any more; its restore is then only
//     checked not to go on silently: the history is marked broken, or the
//     responses found again are the conversation's.)
//   - a failed restore installs nothing: no new sandbox, the store's
//     episode rows unchanged, no live episode added;
//   - every ledger verifies, and every episode left at the end finishes
//     with reward 1.
//
// The default is 3 seeds × 3 rates (about a minute under -race on two
// cores); STASIS_CHAOS_SEEDS=N runs seeds 1..N. Every step is logged with
// the seed, so a failure replays with
// STASIS_CHAOS_SEEDS=N go test -race -run 'TestChaos/seed=S/rate=R' ./coordinator.

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/providers/local"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// chaosMaxRun bounds the faults injected in a row into one operation on one
// target: the chaos is transient, as a provider's failures are, so a
// cleanup that retries gets through.
const chaosMaxRun = 3

// chaosProvider wraps the local provider of one Open of the system and
// injects faults; what it draws and sees is kept in a chaosState, which
// the wrappers of every Open share.
type chaosProvider struct {
	sandbox.Provider
	inner *local.Provider
	*chaosState
}

// chaosState is the chaos providers' faults and what they saw.
type chaosState struct {
	seed uint64

	mu          sync.Mutex
	rate        float64
	streams     map[string]*rand.Rand // op|episode → the fault draws
	runs        map[string]int        // op|target → faults injected in a row
	faults      []string              // injected since the last takeFaults
	deletes     map[string]int        // sandbox → Delete calls that reached the provider
	snapDeletes map[string]int        // snapshot → DeleteSnapshot calls that reached the provider
	snaps       []string              // every snapshot made, in order
	captures    map[string]*capture   // snapshot → what was there at the pause
	forkChecks  map[string][]string   // sandbox made by a Fork → its differences from the capture
	forkedOK    map[string]bool       // snapshots a Fork has shown to restore byte for byte
	ledgerDir   string
}

func newChaosState(seed uint64, rate float64) *chaosState {
	return &chaosState{
		seed: seed, rate: rate,
		streams: map[string]*rand.Rand{}, runs: map[string]int{}, deletes: map[string]int{}, snapDeletes: map[string]int{},
		captures: map[string]*capture{}, forkChecks: map[string][]string{}, forkedOK: map[string]bool{},
	}
}

// wrap is the chaos provider over inner, the local provider of an Open.
func (p *chaosState) wrap(inner *local.Provider) sandbox.Provider {
	return &chaosProvider{Provider: inner, inner: inner, chaosState: p}
}

func (p *chaosState) setRate(r float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rate = r
}

func (p *chaosState) takeFaults() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.faults
	p.faults = nil
	return f
}

func fnv64(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}

// fault draws whether op on target (of episode ep) fails, and how. The
// draws come from a PCG stream per operation and episode, so an episode's
// faults repeat from run to run as far as its calls do.
func (p *chaosState) fault(op, ep, target string) (after bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	sk := op + "|" + ep
	r, ok := p.streams[sk]
	if !ok {
		r = rand.New(rand.NewPCG(p.seed, fnv64(sk)))
		p.streams[sk] = r
	}
	x, plain, late := r.Float64(), r.IntN(2) == 0, r.IntN(2) == 0
	rk := op + "|" + target
	if x >= p.rate || p.runs[rk] >= chaosMaxRun {
		p.runs[rk] = 0
		return false, nil
	}
	p.runs[rk]++
	p.faults = append(p.faults, fmt.Sprintf("%s(%s)", op, ep))
	n := len(p.faults)
	if len(target) > 90 {
		target = target[:90] + "…)"
	}
	if plain {
		return late, fmt.Errorf("%s %s: connection reset by peer (injected fault %d, chaos seed %d)", op, target, n, p.seed)
	}
	return late, sandbox.Errorf(errdefs.ErrUnsupported, op, target, "the service is unavailable (injected fault %d, chaos seed %d)", n, p.seed)
}

func (p *chaosProvider) episodeOf(id string) string {
	info, err := p.inner.Get(context.Background(), id)
	if err != nil || info.Labels["stasis.episode"] == "" {
		return "?"
	}
	return info.Labels["stasis.episode"]
}

func (p *chaosProvider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	ep := spec.Labels["stasis.episode"]
	if _, err := p.fault("create", ep, "episode "+ep); err != nil {
		return sandbox.Info{}, err
	}
	return p.inner.Create(ctx, spec)
}

// Exec fails before the command runs, or after it ran (its answer lost).
func (p *chaosProvider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	after, err := p.fault("exec", p.episodeOf(id), "sandbox "+id+" ("+strings.Join(req.Argv, " ")+")")
	if err == nil {
		return p.inner.Exec(ctx, id, req)
	}
	if after {
		_, _ = p.inner.Exec(ctx, id, req)
	}
	return sandbox.ExecResult{}, err
}

func (p *chaosProvider) Delete(ctx context.Context, id string) error {
	if _, err := p.fault("delete", p.episodeOf(id), "sandbox "+id); err != nil {
		return err
	}
	p.mu.Lock()
	p.deletes[id]++
	p.mu.Unlock()
	return p.inner.Delete(ctx, id)
}

func (p *chaosProvider) DeleteSnapshot(ctx context.Context, id string) error {
	ep := "?"
	if info, err := p.inner.GetSnapshot(ctx, id); err == nil {
		if i := strings.LastIndex(info.Name, "-p"); i > 0 {
			ep = info.Name[:i]
		}
	}
	if _, err := p.fault("delete-snapshot", ep, "snapshot "+id); err != nil {
		return err
	}
	p.mu.Lock()
	p.snapDeletes[id]++
	p.mu.Unlock()
	return p.inner.DeleteSnapshot(ctx, id)
}

// Snapshot captures, right after a snapshot is made (the harness is
// stopped by the pause), the work tree, the harness's directory, the
// harness's conversation and the ledger, for the checks of the forks.
func (p *chaosProvider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	ep := p.episodeOf(id)
	if _, err := p.fault("snapshot", ep, "sandbox "+id); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	info, err := p.inner.Snapshot(ctx, id, name)
	if err != nil {
		return info, err
	}
	c := &capture{episode: ep, sandbox: id}
	c.work, c.err = downloadTree(ctx, p.inner, id, task.WorkDir)
	if c.err == nil {
		c.harness, c.err = downloadTree(ctx, p.inner, id, harnessDir(ep))
	}
	if c.err == nil {
		c.session, c.err = readOptional(ctx, p.inner, id, sessionFile(ep))
	}
	if c.err == nil {
		h, err := ledger.Read(p.ledgerDir, ep)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			c.err = err
		default:
			c.ledger, c.broken = h.Entries, h.Broken
		}
	}
	p.mu.Lock()
	p.snaps = append(p.snaps, info.ID)
	p.captures[info.ID] = c
	p.mu.Unlock()
	return info, nil
}

// Fork compares each fork, before anything runs in it, with the capture of
// its snapshot.
func (p *chaosProvider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	if _, err := p.fault("fork", spec.Labels["stasis.episode"], "snapshot "+snap); err != nil {
		return nil, err
	}
	infos, err := p.inner.Fork(ctx, snap, n, spec)
	if err != nil {
		return infos, err
	}
	p.mu.Lock()
	c := p.captures[snap]
	p.mu.Unlock()
	for _, info := range infos {
		diffs := compareWithCapture(ctx, p.inner, info.ID, c)
		p.mu.Lock()
		p.forkChecks[info.ID] = diffs
		p.forkedOK[snap] = p.forkedOK[snap] || len(diffs) == 0
		p.mu.Unlock()
	}
	return infos, nil
}

// capture is what a sandbox held at a pause.
type capture struct {
	episode, sandbox string
	work, harness    map[string]fileEntry
	session          []byte
	ledger           []ledger.Entry
	broken           bool
	err              error
}

func harnessDir(ep string) string  { return path.Join("/tmp/stasis", ep, "harness") }
func sessionFile(ep string) string { return path.Join(harnessDir(ep), "mini-session.json") }

func readOptional(ctx context.Context, p sandbox.Provider, id, file string) ([]byte, error) {
	b, err := p.ReadFile(ctx, id, file)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil
	}
	return b, err
}

// fileEntry is one tar entry of a downloaded tree.
type fileEntry struct {
	Type     byte
	Mode     int64
	UID, GID int
	Size     int64
	MTime    int64
	Link     string
	Sum      [32]byte
}

// downloadTree reads dir inside a sandbox as a tar stream (nil when dir is
// not there).
func downloadTree(ctx context.Context, p sandbox.Provider, id, dir string) (map[string]fileEntry, error) {
	var buf bytes.Buffer
	if err := p.Download(ctx, id, dir, &buf); err != nil {
		if errors.Is(err, errdefs.ErrNotFound) && strings.Contains(err.Error(), "No such file") {
			return nil, nil
		}
		return nil, err
	}
	tree := map[string]fileEntry{}
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return tree, nil
		}
		if err != nil {
			return nil, err
		}
		e := fileEntry{Type: h.Typeflag, Mode: h.Mode, UID: h.Uid, GID: h.Gid, Size: h.Size, MTime: h.ModTime.Unix(), Link: h.Linkname}
		if h.Typeflag == tar.TypeReg {
			s := sha256.New()
			if _, err := io.Copy(s, tr); err != nil {
				return nil, err
			}
			copy(e.Sum[:], s.Sum(nil))
		}
		tree[path.Clean(h.Name)] = e
	}
}

func diffTrees(what string, want, got map[string]fileEntry) []string {
	var out []string
	names := map[string]bool{}
	for n := range want {
		names[n] = true
	}
	for n := range got {
		names[n] = true
	}
	sorted := make([]string, 0, len(names))
	for n := range names {
		sorted = append(sorted, n)
	}
	sort.Strings(sorted)
	for _, n := range sorted {
		w, inW := want[n]
		g, inG := got[n]
		switch {
		case !inW:
			out = append(out, fmt.Sprintf("%s/%s: in the fork, not at the pause", what, n))
		case !inG:
			out = append(out, fmt.Sprintf("%s/%s: at the pause, not in the fork", what, n))
		case w != g:
			out = append(out, fmt.Sprintf("%s/%s: at the pause %+v, in the fork %+v", what, n, w, g))
		}
	}
	return out
}

// compareWithCapture lists how sandbox id's files differ from a capture.
func compareWithCapture(ctx context.Context, p sandbox.Provider, id string, c *capture) []string {
	if c == nil {
		return []string{"no capture of the snapshot: it was not made through the chaos provider"}
	}
	if c.err != nil {
		return []string{"the capture at the pause failed: " + c.err.Error()}
	}
	work, err := downloadTree(ctx, p, id, task.WorkDir)
	if err != nil {
		return []string{"download the fork's work tree: " + err.Error()}
	}
	h, err := downloadTree(ctx, p, id, harnessDir(c.episode))
	if err != nil {
		return []string{"download the fork's harness directory: " + err.Error()}
	}
	d := diffTrees(task.WorkDir, c.work, work)
	d = append(d, diffTrees(harnessDir(c.episode), c.harness, h)...)
	if len(c.work) == 0 {
		d = append(d, "the work tree at the pause is empty")
	}
	return d
}

// assistantMessages returns the assistant messages of a mini session file.
func assistantMessages(session []byte) ([]json.RawMessage, error) {
	if session == nil {
		return nil, nil
	}
	var f struct {
		Messages []json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(session, &f); err != nil {
		return nil, fmt.Errorf("session file: %w", err)
	}
	var out []json.RawMessage
	for _, m := range f.Messages {
		var head struct {
			Role string `json:"role"`
		}
		if err := json.Unmarshal(m, &head); err != nil {
			return nil, err
		}
		if head.Role == "assistant" {
			out = append(out, m)
		}
	}
	return out, nil
}

// sameMessage reports whether a ledger entry's response carries the
// assistant message msg (equal as JSON values).
func sameMessage(e ledger.Entry, msg json.RawMessage) bool {
	var resp struct {
		Choices []struct {
			Message any `json:"message"`
		} `json:"choices"`
	}
	var m any
	if json.Unmarshal(e.Response, &resp) != nil || len(resp.Choices) == 0 || json.Unmarshal(msg, &m) != nil {
		return false
	}
	return reflect.DeepEqual(resp.Choices[0].Message, m)
}

func sameHashes(a, b []ledger.Entry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Hash != b[i].Hash {
			return false
		}
	}
	return true
}

// The quick built-in tasks: Python and shell (the Go ones compile for half
// a minute, the JavaScript ones start node).
var chaosTasks = []string{
	"py-ini-value-with-equals", "py-money-negative-cents", "py-config-defaults-mutated",
	"sh-renext-spaces", "sh-envget-unanchored-key", "sh-logrotate-shift-order",
}

// TestChaos runs the chaos over seeds 1..STASIS_CHAOS_SEEDS (1 in make
// test: three runs, at no, some and many faults; more seeds are a soak's).
func TestChaos(t *testing.T) {
	seeds := 1
	if s := os.Getenv("STASIS_CHAOS_SEEDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("STASIS_CHAOS_SEEDS=%q: give a number of seeds, 1 or more", s)
		}
		seeds = n
	}
	for seed := 1; seed <= seeds; seed++ {
		t.Run("seed="+strconv.Itoa(seed), func(t *testing.T) {
			for _, rate := range []float64{0, 0.10, 0.25} {
				t.Run(fmt.Sprintf("rate=%.2f", rate), func(t *testing.T) {
					runChaos(t, uint64(seed), rate)
				})
			}
		})
	}
}

// held is a model call held at the gateway.
type held struct {
	call     string
	attempt  int
	h        *relay.Hold
	released bool
}

type chaosRun struct {
	t    *testing.T
	ctx  context.Context
	seed uint64
	rate float64
	rng  *rand.Rand
	w    *world // its local provider is the raw one, without the chaos
	cp   *chaosState
	c    *coordinator.Coordinator

	step       int
	stepName   string
	nextEp     int
	nextCk     int
	episodes   []string                   // every episode started
	holds      map[string]*held           // episode → its current hold
	committed  map[string]json.RawMessage // checkpoint → its records at the commit
	ckOrder    []string
	superseded int
	start      time.Time
}

func runChaos(t *testing.T, seed uint64, rate float64) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cp := newChaosState(seed, rate)
	w := newWrappedWorld(t, cp.wrap, func(c *system.Config) {
		// The invariants here are those of the strict policy: a fault fails
		// the checkpoint (TestStragglerExcluded covers the default).
		c.Stragglers = coordinator.StragglersFail
	})
	cp.ledgerDir = ledger.Dir(w.Gateway.Ledgers()) // the same at every Open
	r := &chaosRun{
		t: t, ctx: ctx, seed: seed, rate: rate, w: w, cp: cp, c: w.Coordinator,
		rng:   rand.New(rand.NewPCG(seed, uint64(rate*1000))),
		holds: map[string]*held{}, committed: map[string]json.RawMessage{}, start: time.Now(),
	}
	t.Cleanup(func() {
		// Whatever happened: nothing held; the world deletes what is left
		// running.
		cp.setRate(0)
		r.releaseAll()
	})
	r.logf("seed %d, fault rate %.2f", seed, rate)

	for r.step = 1; r.step <= 12; r.step++ {
		r.randomStep()
		r.checkInvariants()
	}
	r.finish()
}

func (r *chaosRun) logf(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("[seed %d rate %.2f step %d %s %.1fs] %s", r.seed, r.rate, r.step, r.stepName, time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *chaosRun) failf(format string, args ...any) {
	r.t.Helper()
	r.logFaults()
	r.t.Fatalf("[seed %d rate %.2f step %d %s] %s\nreplay: STASIS_CHAOS_SEEDS=%d go test -race -count=1 -run 'TestChaos/seed=%d/rate=%.2f' ./coordinator",
		r.seed, r.rate, r.step, r.stepName, fmt.Sprintf(format, args...), r.seed, r.seed, r.rate)
}

func (r *chaosRun) randomStep() {
	live := r.c.LiveIDs()
	type option struct {
		name   string
		weight int
		do     func()
	}
	var opts []option
	if len(live) < 3 {
		opts = append(opts, option{"start", 4, r.stepStart})
	}
	if r.anyHeld() {
		opts = append(opts, option{"release", 2, r.stepRelease})
	}
	if len(live) > 0 {
		opts = append(opts, option{"prepare", 4, r.stepPrepare}, option{"retire", 1, r.stepRetire}, option{"verify", 1, r.stepVerify})
	}
	if len(r.episodes) > 0 {
		opts = append(opts, option{"crash", 2, r.stepCrash})
	}
	if len(r.committed) > 0 {
		opts = append(opts, option{"restore", 4, r.stepRestore})
	}
	if len(r.committed) > 1 {
		opts = append(opts, option{"delete-checkpoint", 1, r.stepDeleteCheckpoint})
	}
	total := 0
	for _, o := range opts {
		total += o.weight
	}
	x := r.rng.IntN(total)
	for _, o := range opts {
		if x < o.weight {
			r.stepName = o.name
			o.do()
			r.logFaults()
			return
		}
		x -= o.weight
	}
}

// logFaults logs the faults injected since the last call and counts them.
func (r *chaosRun) logFaults() int {
	r.t.Helper()
	f := r.cp.takeFaults()
	if len(f) > 0 {
		r.logf("faults injected: %s", strings.Join(f, " "))
	}
	return len(f)
}

func (r *chaosRun) anyHeld() bool {
	for _, h := range r.holds {
		if !h.released {
			return true
		}
	}
	return false
}

// hold makes call n of an episode's attempt wait at the gateway.
func (r *chaosRun) hold(ep string, attempt, n int) {
	r.unhold(ep)
	call := attempt*1_000_000 + n
	r.holds[ep] = &held{call: fmt.Sprintf("%s/%d", ep, call), attempt: attempt, h: r.w.HoldAttempt(ep, attempt, call)}
}

// unhold releases and forgets an episode's hold.
func (r *chaosRun) unhold(ep string) {
	if h, ok := r.holds[ep]; ok {
		r.w.Unhold(h.h)
		h.released = true
		delete(r.holds, ep)
	}
}

func (r *chaosRun) releaseAll() {
	for ep := range r.holds {
		r.unhold(ep)
	}
}

// stepStart starts an episode, trying up to three times (new ids) when
// faults make a start fail.
func (r *chaosRun) stepStart() {
	for range 3 {
		if r.startOne() {
			return
		}
		r.logFaults()
	}
}

func (r *chaosRun) startOne() bool {
	r.nextEp++
	id := fmt.Sprintf("ep-%d", r.nextEp)
	tk := chaosTasks[r.rng.IntN(len(chaosTasks))]
	holdAt := 0
	if r.rng.IntN(3) > 0 {
		holdAt = 2 + r.rng.IntN(3)
		r.hold(id, 0, holdAt)
	}
	row, err := r.c.Start(r.ctx, id, tk, "mini")
	if err != nil {
		r.logf("start %s (%s, hold call %d): failed: %v", id, tk, holdAt, err)
		r.unhold(id)
		if _, live := r.c.Live(id); live {
			r.failf("a failed start left %s live", id)
		}
		if _, err := r.w.Store.GetEpisode(r.ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			r.failf("a failed start left %s in the store: %v", id, err)
		}
		r.checkInvariants()
		return false
	}
	r.episodes = append(r.episodes, id)
	r.logf("start %s (%s, hold call %d): sandbox %s", id, tk, holdAt, row.Sandbox)
	return true
}

func (r *chaosRun) stepRelease() {
	var eps []string
	for ep, h := range r.holds {
		if !h.released {
			eps = append(eps, ep)
		}
	}
	sort.Strings(eps)
	ep := eps[r.rng.IntN(len(eps))]
	r.logf("release %s (call %s)", ep, r.holds[ep].call)
	r.unhold(ep)
}

// settle waits until every live episode is parked at its hold or its
// harness has ended, so that a checkpoint finds it at a known place.
func (r *chaosRun) settle() {
	deadline := time.Now().Add(90 * time.Second)
	for _, id := range r.c.LiveIDs() {
		for !r.settled(id) {
			if time.Now().After(deadline) {
				r.failf("episode %s neither reached its held call nor ended within 90s", id)
			}
			time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
		}
	}
}

func (r *chaosRun) settled(id string) bool {
	e, ok := r.c.Live(id)
	if !ok {
		return true
	}
	if h, ok := r.holds[id]; ok && !h.released && h.attempt == e.Attempt() && h.h.Held() > 0 {
		return true
	}
	return r.ended(id, e.SandboxID())
}

// ended reports whether the episode's supervisor has exited (its receipt
// is there), read without the chaos.
func (r *chaosRun) ended(ep, sb string) bool {
	_, err := r.w.local.ReadFile(r.ctx, sb, path.Join("/tmp/stasis", ep, "receipt.json"))
	return err == nil
}

// status asks an episode's supervisor, without the chaos.
func (r *chaosRun) status(ep, sb string) (string, error) {
	var out, errb bytes.Buffer
	env := map[string]string{}
	for k, v := range r.w.Env.BinaryEnv {
		env[k] = v
	}
	res, err := r.w.local.Exec(r.ctx, sb, sandbox.ExecRequest{
		Argv: []string{r.w.Env.BinaryInSandbox, "ctl", "--dir", path.Join("/tmp/stasis", ep), "status"}, Env: env, User: sandbox.UserControl, Stdout: &out, Stderr: &errb,
	})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("ctl status exited %d: %s", res.ExitCode, errb.String())
	}
	var st struct {
		State string `json:"state"`
	}
	if err := json.Unmarshal(out.Bytes(), &st); err != nil {
		return "", err
	}
	return st.State, nil
}

// stepPrepare takes a checkpoint, trying up to three times (new ids) when
// faults make a prepare fail.
func (r *chaosRun) stepPrepare() {
	for range 3 {
		if r.prepareOne() {
			return
		}
		r.logFaults()
		r.checkInvariants()
	}
}

func (r *chaosRun) prepareOne() bool {
	r.settle()
	r.nextCk++
	ck := fmt.Sprintf("ck-%d", r.nextCk)
	ids := r.c.LiveIDs()
	r.cp.mu.Lock()
	nsnaps := len(r.cp.snaps)
	r.cp.mu.Unlock()
	res, err := r.c.Prepare(r.ctx, ck)
	r.cp.mu.Lock()
	made := append([]string(nil), r.cp.snaps[nsnaps:]...)
	r.cp.mu.Unlock()
	hdr, recs, gerr := r.w.Store.Get(r.ctx, ck)
	if gerr != nil {
		r.failf("prepare %s: the checkpoint is not in the store: %v", ck, gerr)
	}
	// Whatever the outcome, no episode stays paused.
	for _, id := range r.c.LiveIDs() {
		e, _ := r.c.Live(id)
		st, serr := r.status(id, e.SandboxID())
		if serr != nil {
			r.failf("prepare %s: status of %s: %v", ck, id, serr)
		}
		if st == "paused" {
			r.failf("prepare %s (err %v): episode %s is left paused", ck, err, id)
		}
	}
	if err != nil && hdr.State == store.StateCommitted {
		// The commit went through and only a continue failed.
		r.logf("prepare %s: committed, but: %v", ck, err)
	} else if err != nil {
		r.logf("prepare %s of %v: failed: %v", ck, ids, err)
		if hdr.State != store.StateFailed {
			r.failf("prepare %s failed but the checkpoint is %s", ck, hdr.State)
		}
		for _, s := range made {
			if _, err := r.w.local.GetSnapshot(r.ctx, s); !errors.Is(err, errdefs.ErrNotFound) {
				r.failf("prepare %s failed but its snapshot %s is left (%v)", ck, s, err)
			}
		}
		return false
	}
	if hdr.State != store.StateCommitted {
		r.failf("prepare %s returned %v but the checkpoint is %s", ck, err, hdr.State)
	}
	var eps []string
	var desc []string
	for _, rec := range recs {
		eps = append(eps, rec.Episode)
		if rec.Finished {
			desc = append(desc, rec.Episode+":finished")
			v, ok, err := r.w.Env.Verifier.Recorded(r.ctx, rec.Episode, rec.Attempt)
			if err != nil || !ok {
				r.failf("checkpoint %s records %s finished, but no verdict is recorded (%v)", ck, rec.Episode, err)
			}
			var rv task.Verdict
			if json.Unmarshal(rec.Result, &rv) != nil || rv.Reward != v.Reward || rv.Output != v.Output {
				r.failf("checkpoint %s: the result of %s is not the recorded verdict", ck, rec.Episode)
			}
			continue
		}
		r.checkPauseRecord(ck, rec)
		desc = append(desc, fmt.Sprintf("%s:%s@%d", rec.Episode, rec.SnapshotID, *rec.RelayDelivered))
	}
	sort.Strings(eps)
	if !reflect.DeepEqual(eps, ids) {
		r.failf("checkpoint %s records %v, the live episodes were %v", ck, eps, ids)
	}
	if err == nil && len(res.Episodes) != len(ids) {
		r.failf("prepare %s: %d figures for %d episodes", ck, len(res.Episodes), len(ids))
	}
	doc, _ := json.Marshal(recs)
	r.committed[ck] = doc
	r.ckOrder = append(r.ckOrder, ck)
	r.logf("prepare %s: committed %s", ck, strings.Join(desc, " "))
	return true
}

// checkPauseRecord checks a paused episode's record against the capture
// of its snapshot: the conversation the harness had acted on is the
// ledger's first k responses, and relay_delivered is k or k+1.
func (r *chaosRun) checkPauseRecord(ck string, rec store.Record) {
	r.cp.mu.Lock()
	c := r.cp.captures[rec.SnapshotID]
	r.cp.mu.Unlock()
	if c == nil || c.err != nil || c.episode != rec.Episode {
		r.failf("checkpoint %s: no good capture of %s's snapshot %s: %+v", ck, rec.Episode, rec.SnapshotID, c)
	}
	if _, err := r.w.local.GetSnapshot(r.ctx, rec.SnapshotID); err != nil {
		r.failf("checkpoint %s: snapshot %s of %s: %v", ck, rec.SnapshotID, rec.Episode, err)
	}
	if rec.RelayDelivered == nil {
		r.failf("checkpoint %s: %s's record has no relay_delivered", ck, rec.Episode)
	}
	msgs, err := assistantMessages(c.session)
	if err != nil {
		r.failf("checkpoint %s: %s: %v", ck, rec.Episode, err)
	}
	k, d := len(msgs), *rec.RelayDelivered
	if c.broken {
		return // a history marked broken is not compared
	}
	if k > len(c.ledger) {
		r.failf("checkpoint %s: %s's harness had acted on %d responses, the ledger held %d at the pause", ck, rec.Episode, k, len(c.ledger))
	}
	for i, m := range msgs {
		if !sameMessage(c.ledger[i], m) {
			r.failf("checkpoint %s: %s's conversation message %d is not the ledger's entry %d", ck, rec.Episode, i+1, i+1)
		}
	}
	// A relaunched relay knows its position only once its first call is
	// answered (it then reports 0).
	if d > 0 && (d < int64(k) || d > int64(k)+1) {
		r.failf("checkpoint %s: %s's relay delivered %d, its harness had acted on %d", ck, rec.Episode, d, k)
	}
}

func (r *chaosRun) stepRetire() {
	live := r.c.LiveIDs()
	id := live[r.rng.IntN(len(live))]
	e, _ := r.c.Live(id)
	sb := e.SandboxID()
	err := r.c.Retire(r.ctx, id)
	r.logf("retire %s (sandbox %s): %v", id, sb, err)
	if err != nil {
		if _, live := r.c.Live(id); !live {
			r.failf("a failed retire of %s dropped it from the live episodes", id)
		}
		return
	}
	r.unhold(id)
	if _, err := r.w.local.Get(r.ctx, sb); !errors.Is(err, errdefs.ErrNotFound) {
		r.failf("retired %s, but its sandbox %s is there (%v)", id, sb, err)
	}
	row, _ := r.w.Store.GetEpisode(r.ctx, id)
	if row.State != store.EpisodeRetired {
		r.failf("retired %s, but the store says %s", id, row.State)
	}
}

func (r *chaosRun) stepVerify() {
	live := r.c.LiveIDs()
	id := live[r.rng.IntN(len(live))]
	e, _ := r.c.Live(id)
	if !r.ended(id, e.SandboxID()) {
		r.unhold(id)
		r.settle()
	}
	v, _, err := r.c.Verify(r.ctx, id)
	r.logf("verify %s: reward %d, %v", id, v.Reward, err)
	if err == nil && v.Reward != 1 {
		r.failf("episode %s: reward %d\n%s", id, v.Reward, v.Output)
	}
}

// stepCrash drops everything in memory: the host side crashes (the
// coordinator, the gateway and the store) and the system is opened again
// on what is on disk; the sandboxes are deleted, or their keepers killed
// (they die with them), or (a restart) kept.
func (r *chaosRun) stepCrash() {
	kind := []string{"delete", "kill", "restart"}[r.rng.IntN(3)]
	r.c.Close()
	infos, err := r.w.local.List(r.ctx, nil)
	if err != nil {
		r.failf("list: %v", err)
	}
	switch kind {
	case "delete":
		for _, info := range infos {
			if err := r.w.local.Delete(r.ctx, info.ID); err != nil {
				r.failf("crash: delete %s: %v", info.ID, err)
			}
		}
	case "kill":
		if len(infos) > 0 {
			var d struct {
				Dir string `json:"dir"`
			}
			if err := json.Unmarshal(infos[0].Descriptor, &d); err != nil {
				r.failf("crash: descriptor: %v", err)
			}
			if _, err := local.Crash(filepath.Dir(filepath.Dir(filepath.Dir(d.Dir)))); err != nil {
				r.failf("crash: %v", err)
			}
		}
	}
	if kind != "restart" {
		r.releaseAll()
	}
	r.w.Crash()
	r.w.Reopen()
	r.c = r.w.Coordinator
	live := r.c.LiveIDs()
	r.logf("crash (%s) of %d sandboxes: live after: %v", kind, len(infos), live)
	if kind != "restart" && len(live) > 0 {
		r.failf("live after a crash that took every sandbox: %v", live)
	}
}

type restoreBefore struct {
	sandboxes []string
	rows      json.RawMessage
	live      []string
}

func (r *chaosRun) snapshotState() restoreBefore {
	infos, err := r.w.local.List(r.ctx, nil)
	if err != nil {
		r.failf("list: %v", err)
	}
	var b restoreBefore
	for _, info := range infos {
		b.sandboxes = append(b.sandboxes, info.ID)
	}
	sort.Strings(b.sandboxes)
	rows, err := r.w.Store.ListEpisodes(r.ctx, "")
	if err != nil {
		r.failf("list episodes: %v", err)
	}
	b.rows, _ = json.Marshal(rows)
	b.live = r.c.LiveIDs()
	return b
}

// records returns a committed checkpoint's records as they were committed.
func (r *chaosRun) records(ck string) []store.Record {
	var recs []store.Record
	if err := json.Unmarshal(r.committed[ck], &recs); err != nil {
		r.failf("records of %s: %v", ck, err)
	}
	return recs
}

func (r *chaosRun) stepRestore() {
	// Mostly a checkpoint with a paused episode: those relaunch.
	var paused []string
	for _, ck := range r.ckOrder {
		for _, rec := range r.records(ck) {
			if !rec.Finished {
				paused = append(paused, ck)
				break
			}
		}
	}
	ck := r.ckOrder[r.rng.IntN(len(r.ckOrder))]
	if len(paused) > 0 && r.rng.IntN(4) > 0 {
		ck = paused[r.rng.IntN(len(paused))]
	}
	recs := r.records(ck)
	retireFirst := r.rng.IntN(3) > 0
	var wasLive []string
	for _, rec := range recs {
		if _, live := r.c.Live(rec.Episode); live {
			wasLive = append(wasLive, rec.Episode)
			if retireFirst {
				err := r.c.Retire(r.ctx, rec.Episode)
				r.logf("retire %s before restoring %s: %v", rec.Episode, ck, err)
				if err == nil {
					r.unhold(rec.Episode)
				}
			}
		}
	}
	r.checkInvariants()
	var stillLive []string
	for _, rec := range recs {
		if _, live := r.c.Live(rec.Episode); live {
			stillLive = append(stillLive, rec.Episode)
		}
	}
	// What the ledgers hold before, and the attempt each relaunch will be.
	pre := map[string]ledger.History{}
	attempt := map[string]int{}
	for _, rec := range recs {
		if rec.Finished {
			continue
		}
		h, err := ledger.ReadIn(r.w.Gateway.Ledgers(), rec.Episode)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			r.failf("ledger of %s: %v", rec.Episode, err)
		}
		pre[rec.Episode] = h
		st, err := r.w.Gateway.Episode(rec.Episode)
		if err != nil {
			r.failf("gateway: %s: %v", rec.Episode, err)
		}
		attempt[rec.Episode] = st.Attempt + 1
		if len(stillLive) == 0 && r.rng.IntN(3) > 0 {
			r.hold(rec.Episode, st.Attempt+1, 2+r.rng.IntN(2))
		}
	}
	before := r.snapshotState()
	r.logFaults()
	// Every episode of the checkpoint, named: the retired ones too.
	var names []string
	for _, rec := range recs {
		names = append(names, rec.Episode)
	}
	res, err := r.c.RestoreWith(r.ctx, ck, coordinator.RestoreOptions{Episodes: names})
	faults := r.logFaults()
	if err != nil {
		r.logf("restore %s (live before: %v, retired first: %v): failed: %v", ck, wasLive, retireFirst, err)
		if len(stillLive) == 0 && faults == 0 {
			r.failf("committed checkpoint %s, none of whose episodes is live, did not restore, and no fault was injected: %v", ck, err)
		}
		for _, ep := range stillLive {
			if !strings.Contains(err.Error(), ep+" is live") {
				r.failf("the refusal of %s does not name the live episode %s: %v", ck, ep, err)
			}
		}
		after := r.snapshotState()
		if !reflect.DeepEqual(before.sandboxes, after.sandboxes) {
			r.failf("a failed restore of %s changed the sandboxes: %v → %v", ck, before.sandboxes, after.sandboxes)
		}
		if !bytes.Equal(before.rows, after.rows) {
			r.failf("a failed restore of %s changed the store's episodes:\n%s\n→\n%s", ck, before.rows, after.rows)
		}
		if !reflect.DeepEqual(before.live, after.live) {
			r.failf("a failed restore of %s changed the live episodes: %v → %v", ck, before.live, after.live)
		}
		for _, rec := range recs {
			if h, ok := r.holds[rec.Episode]; ok && h.attempt == attempt[rec.Episode] {
				r.unhold(rec.Episode)
			}
		}
		return
	}
	if len(stillLive) > 0 {
		r.failf("restore of %s went through over the live episodes %v", ck, stillLive)
	}
	var how []string
	for _, f := range res.Episodes {
		how = append(how, f.Episode+":"+f.Resume)
	}
	r.logf("restore %s (live before: %v, retired first: %v): %s", ck, wasLive, retireFirst, strings.Join(how, " "))
	after := r.snapshotState()
	made := map[string]bool{}
	for _, s := range after.sandboxes {
		made[s] = true
	}
	for _, s := range before.sandboxes {
		delete(made, s)
	}
	for _, rec := range recs {
		row, err := r.w.Store.GetEpisode(r.ctx, rec.Episode)
		if err != nil {
			r.failf("restored %s: %v", rec.Episode, err)
		}
		e, live := r.c.Live(rec.Episode)
		if rec.Finished {
			if live || row.State != store.EpisodeEnded {
				r.failf("restored %s finished: live %v, state %s", rec.Episode, live, row.State)
			}
			continue
		}
		if !live || row.State != store.EpisodeRunning || row.Sandbox != e.SandboxID() {
			r.failf("restored %s: live %v, row %+v", rec.Episode, live, row)
		}
		sb := e.SandboxID()
		if !made[sb] {
			r.failf("restored %s into sandbox %s, which the restore did not make", rec.Episode, sb)
		}
		delete(made, sb)
		info, err := r.w.local.Get(r.ctx, sb)
		if err != nil || info.Source != rec.SnapshotID {
			r.failf("restored %s: sandbox %s comes from %q, the record names %s (%v)", rec.Episode, sb, info.Source, rec.SnapshotID, err)
		}
		r.cp.mu.Lock()
		diffs, checked := r.cp.forkChecks[sb]
		r.cp.mu.Unlock()
		if !checked {
			r.failf("restored %s: its fork %s was not compared with the pause", rec.Episode, sb)
		}
		if len(diffs) > 0 {
			r.failf("restored %s: the fork %s of %s is not what was there at the pause:\n  %s", rec.Episode, sb, rec.SnapshotID, strings.Join(diffs, "\n  "))
		}
		if e.Attempt() != attempt[rec.Episode] {
			r.failf("restored %s at attempt %d, the gateway's next was %d", rec.Episode, e.Attempt(), attempt[rec.Episode])
		}
	}
	if len(made) > 0 {
		r.failf("restore of %s made sandboxes no episode has: %v", ck, made)
	}
	for _, rec := range recs {
		if !rec.Finished {
			r.checkRestoredLedger(ck, rec, pre[rec.Episode], attempt[rec.Episode])
		}
	}
}

// checkRestoredLedger waits for the relaunched harness's first model call
// (or its end) and checks the episode's ledger: the first k entries are
// the ones recorded at the pause, byte for byte (k: the responses the
// harness had acted on), and the relaunched attempt's entries follow, the
// first a boundary.
func (r *chaosRun) checkRestoredLedger(ck string, rec store.Record, pre ledger.History, attempt int) {
	r.cp.mu.Lock()
	c := r.cp.captures[rec.SnapshotID]
	r.cp.mu.Unlock()
	msgs, _ := assistantMessages(c.session)
	k := len(msgs)
	P := c.ledger
	e, _ := r.c.Live(rec.Episode)
	var h ledger.History
	deadline := time.Now().Add(90 * time.Second)
	for {
		var err error
		h, err = ledger.ReadIn(r.w.Gateway.Ledgers(), rec.Episode)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			r.failf("ledger of %s: %v", rec.Episode, err)
		}
		// The match's cut comes before the call's entry: wait for the entry.
		done := r.ended(rec.Episode, e.SandboxID())
		for _, x := range h.Entries {
			done = done || x.Attempt == attempt
		}
		for _, ev := range h.Events[min(len(pre.Events), len(h.Events)):] {
			done = done || ev.Kind == "broken"
		}
		if done {
			if r.ended(rec.Episode, e.SandboxID()) {
				// Read once more: the harness's last call is in.
				if h2, err := ledger.ReadIn(r.w.Gateway.Ledgers(), rec.Episode); err == nil {
					h = h2
				}
			}
			break
		}
		if time.Now().After(deadline) {
			r.failf("restored %s: its relaunched harness made no model call and did not end within 90s", rec.Episode)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	newBroken := false
	for _, ev := range h.Events[len(pre.Events):] {
		newBroken = newBroken || ev.Kind == "broken"
	}
	L := h.Entries
	first := -1
	for i, x := range L {
		if x.Attempt == attempt {
			first = i
			break
		}
	}
	intact := !c.broken && len(pre.Entries) >= k && sameHashes(pre.Entries[:k], P[:k])
	if !intact {
		// The ledger no longer holds the history this checkpoint recorded:
		// a restore of an earlier checkpoint cut it and the episode went
		// on (the ledger has no way back to a cut history). The gateway
		// must then mark the history broken, or find the conversation's
		// responses again (the scripted model answers alike), never go on
		// silently.
		r.superseded++
		r.logf("restored %s from %s: the ledger no longer holds the checkpoint's history (a later restore of an earlier checkpoint cut it): broken %v", rec.Episode, ck, newBroken)
		if newBroken {
			return
		}
		if first < 0 {
			// The harness ended without a call: nothing marks the ledger,
			// which holds another history than the conversation.
			r.logf("KNOWN LIMITATION: %s ended without a model call; its ledger holds the history of the restore that superseded %s", rec.Episode, ck)
			return
		}
		if first != k || len(L) <= k || !L[k].Boundary {
			r.failf("restored %s from a superseded checkpoint: not marked broken, and the relaunch's entries do not follow its %d responses with a boundary (first of attempt %d at %d of %d)", rec.Episode, k, attempt, first, len(L))
		}
		for i, m := range msgs {
			if !sameMessage(L[i], m) {
				r.failf("restored %s from a superseded checkpoint: not marked broken, and ledger entry %d is not the conversation's message", rec.Episode, i+1)
			}
		}
		return
	}
	if newBroken {
		r.failf("restored %s: the relaunch marked the ledger broken: %s", rec.Episode, h.Reason)
	}
	if len(L) < k || !sameHashes(L[:k], P[:k]) {
		r.failf("restored %s: the ledger's first %d entries are not the ones recorded at the pause (%d entries now)", rec.Episode, k, len(L))
	}
	if first < 0 {
		// The harness ended without a call: its conversation was done.
		if len(L) != k {
			r.failf("restored %s: no call of attempt %d, and the ledger has %d entries, not the %d the harness acted on", rec.Episode, attempt, len(L), k)
		}
		return
	}
	if first != k {
		r.failf("restored %s: attempt %d's first entry is at %d, after the %d the harness acted on", rec.Episode, attempt, first+1, k)
	}
	if want := !(k == 0 && len(pre.Entries) == 0); L[k].Boundary != want {
		r.failf("restored %s: the relaunch's first entry (seq %d) has boundary %v, want %v", rec.Episode, L[k].Seq, L[k].Boundary, want)
	}
	for _, x := range L[k:] {
		if x.Attempt != attempt {
			r.failf("restored %s: entry %d after the boundary is of attempt %d, not %d", rec.Episode, x.Seq, x.Attempt, attempt)
		}
	}
}

func (r *chaosRun) stepDeleteCheckpoint() {
	i := r.rng.IntN(len(r.ckOrder))
	ck := r.ckOrder[i]
	freed, err := r.c.DeleteCheckpoint(r.ctx, ck)
	r.logf("delete checkpoint %s: freed %d snapshots: %v", ck, len(freed), err)
	if _, _, gerr := r.w.Store.Get(r.ctx, ck); errors.Is(gerr, errdefs.ErrNotFound) {
		delete(r.committed, ck)
		r.ckOrder = append(r.ckOrder[:i:i], r.ckOrder[i+1:]...)
	} else if err == nil {
		r.failf("deleted checkpoint %s is still in the store (%v)", ck, gerr)
	}
}

// checkInvariants checks what must hold between any two steps.
func (r *chaosRun) checkInvariants() {
	r.t.Helper()
	ctx := r.ctx
	// Sandboxes: exactly the live episodes'.
	want := map[string]string{}
	for _, id := range r.c.LiveIDs() {
		e, _ := r.c.Live(id)
		want[e.SandboxID()] = id
	}
	infos, err := r.w.local.List(ctx, nil)
	if err != nil {
		r.failf("list: %v", err)
	}
	listed := map[string]bool{}
	for _, info := range infos {
		listed[info.ID] = true
		if _, ok := want[info.ID]; !ok {
			r.failf("sandbox %s (%v, %s) leaked: no live episode has it", info.ID, info.Labels, info.State)
		}
	}
	for sb, id := range want {
		if !listed[sb] {
			r.failf("live episode %s's sandbox %s is gone", id, sb)
		}
	}
	// Nothing deleted twice.
	r.cp.mu.Lock()
	for id, n := range r.cp.deletes {
		if n > 1 {
			r.cp.mu.Unlock()
			r.failf("sandbox %s was deleted %d times", id, n)
		}
	}
	for id, n := range r.cp.snapDeletes {
		if n > 1 {
			r.cp.mu.Unlock()
			r.failf("snapshot %s was deleted %d times", id, n)
		}
	}
	snaps := append([]string(nil), r.cp.snaps...)
	r.cp.mu.Unlock()
	// Checkpoints: the committed ones unchanged, nothing pending, and a
	// snapshot exists exactly when a committed checkpoint names it.
	named := map[string]string{}
	cks, err := r.w.Store.List(ctx, store.ListOptions{})
	if err != nil {
		r.failf("list checkpoints: %v", err)
	}
	for _, ck := range cks {
		switch ck.State {
		case store.StatePending:
			r.failf("checkpoint %s is left pending", ck.ID)
		case store.StateCommitted:
			_, recs, err := r.w.Store.Get(ctx, ck.ID)
			if err != nil {
				r.failf("checkpoint %s: %v", ck.ID, err)
			}
			doc, _ := json.Marshal(recs)
			if want, ok := r.committed[ck.ID]; !ok || !bytes.Equal(doc, want) {
				r.failf("committed checkpoint %s changed:\n%s\n→\n%s", ck.ID, want, doc)
			}
			for _, rec := range recs {
				if rec.SnapshotID != "" {
					named[rec.SnapshotID] = ck.ID
				}
			}
		}
	}
	for ck := range r.committed {
		if _, _, err := r.w.Store.Get(ctx, ck); err != nil {
			r.failf("committed checkpoint %s is gone: %v", ck, err)
		}
	}
	for _, s := range snaps {
		_, err := r.w.local.GetSnapshot(ctx, s)
		ck, isNamed := named[s]
		switch {
		case isNamed && err != nil:
			r.failf("snapshot %s of committed checkpoint %s: %v", s, ck, err)
		case !isNamed && !errors.Is(err, errdefs.ErrNotFound):
			r.failf("snapshot %s leaked: no committed checkpoint names it (%v)", s, err)
		}
	}
	// The store's episodes agree with the live ones.
	rows, err := r.w.Store.ListEpisodes(ctx, "")
	if err != nil {
		r.failf("list episodes: %v", err)
	}
	for _, row := range rows {
		e, live := r.c.Live(row.ID)
		switch {
		case row.State == store.EpisodeRunning && !live:
			r.failf("episode %s is running in the store but not live", row.ID)
		case live && row.State != store.EpisodeRunning && row.State != store.EpisodeEnded:
			r.failf("episode %s is live but %s in the store", row.ID, row.State)
		case live && row.Sandbox != e.SandboxID():
			r.failf("episode %s is live in %s, the store says %s", row.ID, e.SandboxID(), row.Sandbox)
		}
	}
	// Every ledger verifies.
	for _, ep := range r.episodes {
		rep, err := ledger.VerifyIn(r.w.Gateway.Ledgers(), ep)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil || !rep.OK {
			r.failf("ledger of %s does not verify: %+v %v", ep, rep, err)
		}
	}
}

// finish lets every live episode end, without faults: each must reach
// reward 1; then every committed checkpoint's snapshots must fork byte for
// byte; then everything is retired and deleted, and nothing may be left.
func (r *chaosRun) finish() {
	r.step, r.stepName = r.step+1, "finish"
	r.cp.setRate(0)
	r.releaseAll()
	r.settle()
	for _, id := range r.c.LiveIDs() {
		v, _, err := r.c.Verify(r.ctx, id)
		if err != nil || v.Reward != 1 {
			r.failf("episode %s at the end: reward %d, %v\n%s", id, v.Reward, err, v.Output)
		}
	}
	r.checkInvariants()
	for _, ck := range r.ckOrder {
		for _, rec := range r.records(ck) {
			r.cp.mu.Lock()
			checked := r.cp.forkedOK[rec.SnapshotID]
			r.cp.mu.Unlock()
			if rec.Finished || checked {
				continue // a restore compared a fork of it already
			}
			infos, err := r.w.local.Fork(r.ctx, rec.SnapshotID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(10 * time.Minute)})
			if err != nil {
				r.failf("checkpoint %s: fork %s: %v", ck, rec.SnapshotID, err)
			}
			r.cp.mu.Lock()
			c := r.cp.captures[rec.SnapshotID]
			r.cp.mu.Unlock()
			diffs := compareWithCapture(r.ctx, r.w.local, infos[0].ID, c)
			if err := r.w.local.Delete(r.ctx, infos[0].ID); err != nil {
				r.failf("delete a check fork: %v", err)
			}
			if len(diffs) > 0 {
				r.failf("checkpoint %s: snapshot %s of %s does not fork to what was there at the pause:\n  %s", ck, rec.SnapshotID, rec.Episode, strings.Join(diffs, "\n  "))
			}
		}
	}
	if err := r.c.Shutdown(r.ctx); err != nil {
		r.failf("shutdown: %v", err)
	}
	for _, ck := range append([]string(nil), r.ckOrder...) {
		if _, err := r.c.DeleteCheckpoint(r.ctx, ck); err != nil {
			r.failf("delete checkpoint %s: %v", ck, err)
		}
		delete(r.committed, ck)
	}
	r.ckOrder = nil
	r.checkInvariants()
	if infos, _ := r.w.local.List(r.ctx, nil); len(infos) > 0 {
		r.failf("sandboxes left at the end: %+v", infos)
	}
	r.logf("done: %d episodes, %d snapshots, %d restores from a superseded history", len(r.episodes), len(r.cp.snaps), r.superseded)
}
