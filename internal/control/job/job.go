// Package job owns `stasis run`, the main job: N episodes on the embedded
// defaults (the local provider, SQLite, the scripted model), a checkpoint
// when they are about a given fraction done, and, with a crash, everything
// killed as a crash would kill it (the server, the supervisors and the
// sandboxes), the server started again on its state, the checkpoint
// restored, every episode finished and verified, and a report.
//
// The job drives a real `stasis serve` child process over its HTTP API, as
// a trainer would, and hosts the scripted model itself (a model server is
// not part of what crashes).
package job

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"stasis/client"
	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/model"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness/opencode"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/providers/local"
	"stasis/internal/providers/microvm"
	"stasis/internal/providers/opensandbox"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// Options configure a run.
type Options struct {
	Tasks string // builtin, a task directory, or SWE-bench JSONL
	Repos string
	// Envs is --envs: where SWE-bench environments are built and cached
	// (see task.EnvsOption).
	Envs    string
	N       int    // episodes
	Harness string // mini, opencode, mixed
	// Provider is the sandbox provider: local, or microvm (shell tasks and
	// the mini harness only: the guest has busybox and stasis, no Python,
	// Node.js or Go), or a hosted one, opensandbox or e2b (the mini
	// harness; configured by their environment variables, which the serve
	// child inherits).
	Provider string
	// GuestBinary is the static stasis for microVM guests (default: Exe,
	// which must then be static).
	GuestBinary string
	// GuestMemory is each microVM guest's memory, e.g. 1GiB (serve's
	// --guest-memory; empty: its default).
	GuestMemory string
	// GatewayListen and GatewayURL: where the gateway listens for a hosted
	// provider's sandboxes (default 127.0.0.1:0), and its URL as they
	// reach it (default: http:// and the address it listens on).
	GatewayListen, GatewayURL string
	// CheckpointAt is the fraction of the episodes' model calls after which
	// the checkpoint is taken (0 < x < 1).
	CheckpointAt float64
	Crash        bool
	// Stragglers is what the checkpoint does with an episode that cannot
	// be checkpointed: exclude (the default: commit without it, named in
	// the report) or fail.
	Stragglers string
	// Image is the sandboxes' image where a task names none (serve
	// --image); empty: the provider's own root.
	Image string
	// State is the run's state directory (default: a fresh directory under
	// $TMPDIR, removed at the end unless Keep).
	State string
	Keep  bool
	// TokenDelay slows the scripted model so that a checkpoint falls
	// mid-episode (default 2ms per token).
	TokenDelay time.Duration
	// Exe and ExeEnv run the server (default: this executable).
	Exe    string
	ExeEnv []string
	// Progress receives progress (nil: none).
	Progress Progress
	Log      *slog.Logger
	Timeout  time.Duration // the whole run (default 20 minutes)
	// Nodes, above 1, runs that many `stasis serve --node` processes,
	// each with its own state directory, on the shared Store (a
	// postgres:// URL) and Blobs (an s3:// URL); the crash kills every
	// node, and only all but the last come back: the restore places the
	// lost node's episodes on the survivors.
	Nodes        int
	Store, Blobs string
	// node is the node a per-node copy of the options serves as.
	node string
}

// Progress is told what the run does; Bars draws bars on a terminal.
type Progress interface {
	Phase(name string, total int)
	Set(done int)
	Done()
}

// EpisodeReport is one episode's line of the report.
type EpisodeReport struct {
	// Node is the node that drove it at the end (a run over --nodes).
	Node     string `json:"node,omitempty"`
	ID       string `json:"id"`
	Task     string `json:"task"`
	Harness  string `json:"harness"`
	Provider string `json:"provider"`
	Resume   string `json:"resume"` // in_place | relaunch | none
	// ResumeWhy says why a restore relaunched the episode.
	ResumeWhy string `json:"resume_why,omitempty"`
	// ClockStep is how far a resume in place moved the guest's wall clock
	// (seconds), under the clock policy.
	ClockStep      *float64 `json:"clock_step_s,omitempty"`
	Reward         int      `json:"reward"`
	ModelCalls     int      `json:"model_calls"`
	LedgerVerified bool     `json:"ledger_verified"`
	// Verdict is resolved, unresolved or error; Reason says why for an
	// error (or an unresolved run that failed as a whole).
	Verdict string `json:"verdict"`
	Reason  string `json:"reason,omitempty"`
	// Environment is what the tests ran in.
	Environment string `json:"environment,omitempty"`
	// FailToPass and PassToPass are each listed test's outcome (passed,
	// failed, skipped, missing).
	FailToPass map[string]string `json:"fail_to_pass"`
	PassToPass map[string]string `json:"pass_to_pass"`
	// TestsRemoved are test files the agent added, removed before verify;
	// TestsReverted test files of the task it changed, restored.
	TestsRemoved  []string `json:"tests_removed,omitempty"`
	TestsReverted []string `json:"tests_reverted,omitempty"`
	// ResolvedAtCheckpoint: the episode had already ended, resolved, when
	// the checkpoint was taken.
	ResolvedAtCheckpoint bool `json:"resolved_at_checkpoint"`
}

// Report is the run's result.
type Report struct {
	Episodes   []EpisodeReport `json:"episodes"`
	Checkpoint struct {
		ID       string  `json:"id"`
		Seconds  float64 `json:"seconds"`
		Episodes int     `json:"episodes"`
		// Excluded are the episodes it was committed without, with why.
		Excluded []Excluded `json:"excluded,omitempty"`
	} `json:"checkpoint"`
	Restore *struct {
		Seconds float64 `json:"seconds"`
	} `json:"restore"`
	// Resolved counts episodes with reward 1 at the end; ResolvedBefore
	// those resolved when the checkpoint was taken.
	Resolved       int `json:"resolved"`
	ResolvedBefore int `json:"resolved_before"`
	// Errors counts verdicts whose tests could not judge the work tree.
	Errors  int  `json:"errors"`
	Crashed bool `json:"crashed"`
	// Nodes is how many `stasis serve --node` the run ran (0: one server).
	Nodes   int     `json:"nodes,omitempty"`
	Killed  int     `json:"sandboxes_killed,omitempty"`
	Seconds float64 `json:"seconds"`
	State   string  `json:"state,omitempty"`
}

// episodeView is the server's view of an episode, as its API answers.
type episodeView = client.EpisodeView

// ended says whether the episode's harness has ended.
func harnessEnded(v episodeView) bool {
	return v.State == store.EpisodeEnded || (v.Status != nil && v.Status.State == supervisor.StateExited)
}

// Excluded is an episode a checkpoint was committed without.
type Excluded struct {
	Episode string `json:"episode"`
	Reason  string `json:"reason"`
}

// Run runs the job and returns its report. Nothing it started is left
// running when it returns.
func Run(ctx context.Context, o Options) (rep *Report, err error) {
	start := time.Now()
	if err := o.defaults(); err != nil {
		return nil, errdefs.Errorf(errdefs.ErrInvalid, "%w", err)
	}
	if o.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.Timeout)
		defer cancel()
	}
	solvable, scripts, turns, err := o.solvableTasks()
	if err != nil {
		return nil, err
	}
	modelURL, done, err := o.stateAndModel(scripts)
	if err != nil {
		return nil, err
	}
	defer done(&err)
	if o.Nodes > 1 {
		return runNodes(ctx, o, start, solvable, modelURL, turns)
	}

	srv, err := startServer(ctx, o, modelURL)
	if err != nil {
		return nil, err
	}
	// Whatever happens: no server, no sandbox left.
	defer func() {
		if cerr := cleanup(srv, o); cerr != nil && err == nil {
			err = cerr
		}
	}()

	rep = &Report{Crashed: o.Crash}
	if o.Keep {
		rep.State = o.State
	}
	plan := o.plan(solvable)
	if err := startEpisodes(ctx, srv, o, plan); err != nil {
		return rep, err
	}
	if err := runToCheckpoint(ctx, srv, o, plan, turns); err != nil {
		return rep, err
	}
	ckID, finishedAt, err := takeCheckpoint(ctx, srv, o, rep)
	if err != nil {
		return rep, err
	}
	var rs restored
	if o.Crash {
		if srv, rs, err = crashAndRestore(ctx, srv, o, modelURL, ckID, rep); err != nil {
			return rep, err
		}
	}
	if err := runToEnd(ctx, srv, o, len(plan)); err != nil {
		return rep, err
	}
	if err := verifyAll(ctx, srv, o, plan, finishedAt, rs, rep); err != nil {
		return rep, err
	}
	rep.Seconds = time.Since(start).Seconds()
	return rep, nil
}

// stateAndModel makes the run's state directory (removed at the end unless
// kept) and serves the scripted model in this process (it outlives the
// servers); done, deferred, stops the model and removes the directory,
// setting *err if that fails and nothing failed before.
func (o *Options) stateAndModel(scripts []*model.Script) (modelURL string, done func(*error), err error) {
	madeState, err := o.makeState()
	if err != nil {
		return "", nil, err
	}
	removeState := func(err *error) {
		if madeState && !o.Keep {
			if rerr := os.RemoveAll(o.State); rerr != nil && *err == nil {
				*err = rerr
			}
		}
	}
	modelURL, stopModel, err := serveModel(scripts, o.TokenDelay)
	if err != nil {
		removeState(&err)
		return "", nil, err
	}
	return modelURL, func(err *error) { _ = stopModel(); removeState(err) }, nil
}

// solvableTasks loads the tasks and keeps those the scripted model can
// solve (they have a reference solution) on the provider, interleaved,
// with their scripts and the number of turns of each task's.
func (o *Options) solvableTasks() (solvable []*task.Task, scripts []*model.Script, turns map[string]int, err error) {
	lo, err := task.EnvsOption(o.Envs)
	if err != nil {
		return nil, nil, nil, err
	}
	lo.Repos, lo.Log = o.Repos, o.Log
	ts, problems, err := task.Load(o.Tasks, lo)
	if err != nil {
		return nil, nil, nil, err
	}
	for _, p := range problems {
		o.Log.Warn("task not loaded", "err", p)
	}
	for _, t := range ts {
		if t.Solution == nil {
			continue
		}
		if o.Provider == microvm.Name && !microvm.CanRun(t.Language, cmp.Or(t.Image, o.Image)) {
			continue
		}
		solvable = append(solvable, t)
	}
	if len(solvable) == 0 {
		if o.Provider == microvm.Name {
			return nil, nil, nil, fmt.Errorf("tasks %s: none the microVM guest can run (it has busybox: shell tasks) has a reference solution", o.Tasks)
		}
		return nil, nil, nil, fmt.Errorf("tasks %s: none has a reference solution, so the scripted model cannot solve any", o.Tasks)
	}
	solvable = interleave(solvable)
	if scripts, err = task.Scripts(solvable); err != nil {
		return nil, nil, nil, err
	}
	turns = map[string]int{}
	for i, s := range scripts {
		turns[solvable[i].ID] = len(s.Turns)
	}
	return solvable, scripts, turns, nil
}

// serveModel serves the scripted model in this process, where it outlives
// the server: its URL, and stop.
func serveModel(scripts []*model.Script, tokenDelay time.Duration) (url string, stop func() error, err error) {
	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	msrv := &http.Server{Handler: model.New(model.Options{Scripts: scripts, TokenDelay: tokenDelay})}
	go func() { _ = msrv.Serve(mln) }()
	return "http://" + mln.Addr().String(), msrv.Close, nil
}

// makeState makes the state directory, a new one under $TMPDIR when
// o.State is empty (made then says so).
func (o *Options) makeState() (made bool, err error) {
	if o.State == "" {
		if o.State, err = os.MkdirTemp("", "stasis-run-"); err != nil {
			return false, err
		}
		return true, nil
	}
	return false, os.MkdirAll(o.State, 0o755)
}

// planned is an episode the run starts.
type planned struct{ id, task, harness string }

// plan names the N episodes and gives each its task, in turn, and its
// harness (mini and opencode in turn when mixed).
func (o *Options) plan(solvable []*task.Task) []planned {
	var plan []planned
	for i := range o.N {
		h := o.Harness
		if h == "mixed" {
			h = []string{"mini", "opencode"}[i%2]
		}
		t := solvable[i%len(solvable)]
		plan = append(plan, planned{fmt.Sprintf("ep-%03d", i+1), t.ID, h})
	}
	return plan
}

func startEpisodes(ctx context.Context, srv *server, o Options, plan []planned) error {
	o.Progress.Phase("start episodes", len(plan))
	for i, p := range plan {
		if _, err := srv.api.StartEpisode(ctx, client.StartRequest{ID: p.id, Task: p.task, Harness: p.harness}); err != nil {
			return fmt.Errorf("start %s: %w", p.id, err)
		}
		o.Progress.Set(i + 1)
	}
	o.Progress.Done()
	return nil
}

// runToCheckpoint waits until about CheckpointAt of the calls are made
// (or every harness ended).
func runToCheckpoint(ctx context.Context, srv fleet, o Options, plan []planned, turns map[string]int) error {
	expected := 0
	for _, p := range plan {
		expected += turns[p.task]
	}
	o.Progress.Phase(fmt.Sprintf("episodes to %.0f%%", 100*o.CheckpointAt), expected)
	for {
		views, err := srv.episodes(ctx)
		if err != nil {
			return err
		}
		made, ended := 0, 0
		for _, v := range views {
			made += min(int(v.ModelCalls), turns[v.Task])
			if harnessEnded(v) {
				ended++
			}
		}
		o.Progress.Set(made)
		if float64(made) >= o.CheckpointAt*float64(expected) || ended == len(views) {
			break
		}
		if err := pause(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
	o.Progress.Done()
	return nil
}

// takeCheckpoint takes the checkpoint, ckID, into the report; finishedAt
// says which episodes had finished then.
func takeCheckpoint(ctx context.Context, srv *server, o Options, rep *Report) (ckID string, finishedAt map[string]bool, err error) {
	o.Progress.Phase("checkpoint", 1)
	ckID = "ckpt-" + time.Now().UTC().Format("20060102T150405")
	t0 := time.Now()
	ck, err := srv.api.Checkpoint(ctx, client.CheckpointRequest{ID: ckID, Stragglers: o.Stragglers})
	if err != nil {
		return "", nil, fmt.Errorf("checkpoint: %w", err)
	}
	rep.Checkpoint.ID, rep.Checkpoint.Seconds = ckID, time.Since(t0).Seconds()
	for _, e := range ck.Episodes {
		if e.Excluded {
			rep.Checkpoint.Excluded = append(rep.Checkpoint.Excluded, Excluded{Episode: e.Episode, Reason: e.Reason})
			continue
		}
		rep.Checkpoint.Episodes++
	}
	o.Progress.Set(1)
	o.Progress.Done()
	finishedAt = map[string]bool{}
	for _, e := range ck.Episodes {
		finishedAt[e.Episode] = e.Finished
	}
	if len(ck.Shares) > 0 {
		// Over several nodes the answer's episodes are the asked node's:
		// the records say what every node's were.
		_, recs, err := srv.api.GetCheckpoint(ctx, ckID)
		if err != nil {
			return "", nil, fmt.Errorf("checkpoint: %w", err)
		}
		rep.Checkpoint.Episodes = len(recs)
		for _, r := range recs {
			finishedAt[r.Episode] = r.Finished
		}
	}
	return ckID, finishedAt, nil
}

// restored is what the restore said of each episode: why it relaunched,
// and how far a resume in place moved its clock.
type restored struct {
	why       map[string]string
	clockStep map[string]*float64
}

// crashAndRestore kills everything as a crash would (the server and every
// sandbox, no clean shutdown), starts a new server on the same state and
// restores the checkpoint there. It returns the server the run has now
// (the old one, dead, when the crash failed; nil when the new one did not
// start).
func crashAndRestore(ctx context.Context, srv *server, o Options, modelURL, ckID string, rep *Report) (*server, restored, error) {
	rs := restored{why: map[string]string{}, clockStep: map[string]*float64{}}
	o.Progress.Phase("crash", 1)
	_ = srv.cmd.Process.Signal(syscall.SIGKILL)
	_ = srv.cmd.Wait()
	n, err := crashSandboxes(o.State)
	if err == nil && hostedProvider(o.Provider) {
		n, err = crashHosted(ctx, o.Provider)
	}
	if err != nil {
		return srv, rs, fmt.Errorf("crash: %w", err)
	}
	rep.Killed = n
	o.Progress.Set(1)
	o.Progress.Done()
	// A new server on the same state, and the restore.
	if srv, err = startServer(ctx, o, modelURL); err != nil {
		return srv, rs, err
	}
	o.Progress.Phase("restore", 1)
	t0 := time.Now()
	res, err := srv.api.Restore(ctx, ckID)
	if err != nil {
		return srv, rs, fmt.Errorf("restore: %w", err)
	}
	for _, e := range res.Episodes {
		rs.why[e.Episode] = e.ResumeWhy
		if e.Clock != nil {
			step := e.Clock.Step
			rs.clockStep[e.Episode] = &step
		}
	}
	rep.Restore = &struct {
		Seconds float64 `json:"seconds"`
	}{time.Since(t0).Seconds()}
	o.Progress.Set(1)
	o.Progress.Done()
	return srv, rs, nil
}

// runToEnd lets every episode finish.
func runToEnd(ctx context.Context, srv fleet, o Options, n int) error {
	o.Progress.Phase("episodes to the end", n)
	for {
		views, err := srv.episodes(ctx)
		if err != nil {
			return err
		}
		ended := 0
		for _, v := range views {
			if harnessEnded(v) {
				ended++
			}
		}
		o.Progress.Set(ended)
		if ended == len(views) {
			break
		}
		if err := pause(ctx, 200*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for the episodes to end: %w", err)
		}
	}
	o.Progress.Done()
	return nil
}

// verifyAll verifies every episode and reads its figures into the report.
func verifyAll(ctx context.Context, srv fleet, o Options, plan []planned, finishedAt map[string]bool, rs restored, rep *Report) error {
	o.Progress.Phase("verify", len(plan))
	for i, p := range plan {
		api, err := srv.apiOf(ctx, p.id)
		if err != nil {
			return fmt.Errorf("verify %s: %w", p.id, err)
		}
		vr, err := api.Verify(ctx, p.id)
		if err != nil {
			return fmt.Errorf("verify %s: %w", p.id, err)
		}
		v, err := api.Episode(ctx, p.id)
		if err != nil {
			return err
		}
		resume := v.Resume
		if resume == "" {
			resume = "none"
		}
		er := EpisodeReport{Node: v.Node, ID: p.id, Task: p.task, Harness: p.harness, Provider: v.Provider, Resume: resume, ResumeWhy: rs.why[p.id], ClockStep: rs.clockStep[p.id],
			Reward: vr.Verdict.Reward, ModelCalls: int(v.ModelCalls), LedgerVerified: v.LedgerOK,
			ResolvedAtCheckpoint: finishedAt[p.id] && vr.Verdict.Reward == 1,
			Verdict:              vr.Verdict.Status, Reason: vr.Verdict.Reason, Environment: vr.Verdict.Environment,
			FailToPass: vr.Verdict.FailToPass, PassToPass: vr.Verdict.PassToPass, TestsRemoved: vr.Verdict.TestsRemoved, TestsReverted: vr.Verdict.TestsReverted}
		if er.Reward == 1 {
			rep.Resolved++
		}
		if er.Verdict == task.StatusError {
			rep.Errors++
		}
		if er.ResolvedAtCheckpoint {
			rep.ResolvedBefore++
		}
		rep.Episodes = append(rep.Episodes, er)
		o.Progress.Set(i + 1)
	}
	o.Progress.Done()
	return nil
}

// interleave orders tasks so that languages take turns (go, javascript,
// python, shell, go, ...), each language's tasks in id order: a short run
// sees every language, not three slow Go builds first.
func interleave(ts []*task.Task) []*task.Task {
	by := map[string][]*task.Task{}
	var langs []string
	for _, t := range ts {
		if _, ok := by[t.Language]; !ok {
			langs = append(langs, t.Language)
		}
		by[t.Language] = append(by[t.Language], t)
	}
	sort.Strings(langs)
	var out []*task.Task
	for len(out) < len(ts) {
		for _, l := range langs {
			if len(by[l]) > 0 {
				out = append(out, by[l][0])
				by[l] = by[l][1:]
			}
		}
	}
	return out
}

func (o *Options) defaults() error {
	if o.N <= 0 {
		return errors.New("--episodes must be at least 1")
	}
	if err := coordinator.CheckStragglers(o.Stragglers); err != nil {
		return fmt.Errorf("--%w", err)
	}
	switch o.Harness {
	case "":
		o.Harness = "mini"
	case "mini", "opencode", "mixed":
	default:
		return fmt.Errorf("--harness %q: want mini, opencode or mixed", o.Harness)
	}
	if o.Harness != "mini" {
		if _, err := opencode.Binary(); err != nil {
			return fmt.Errorf("--harness %s needs OpenCode: %w", o.Harness, err)
		}
	}
	if o.Provider == "" {
		o.Provider = local.Name
	}
	if _, err := sandbox.Lookup(o.Provider); err != nil {
		return fmt.Errorf("--provider: %w", err)
	}
	// What each provider can run.
	switch o.Provider {
	case microvm.Name:
		if o.Harness != "mini" && o.Image == "" {
			return fmt.Errorf("--harness %s on --provider microvm needs --image: OpenCode needs a C library, and a guest without an image has busybox and stasis only (the Debian image: make deps-image, then --image oci:.tools/image/debian:stasis)", o.Harness)
		}
	case opensandbox.Name:
		if o.Harness != "mini" {
			return fmt.Errorf("--provider %s runs the mini harness (stasis is copied into each sandbox; OpenCode is not): use --harness mini", o.Provider)
		}
	}
	if o.CheckpointAt == 0 {
		o.CheckpointAt = 0.5
	}
	if o.CheckpointAt <= 0 || o.CheckpointAt >= 1 {
		return fmt.Errorf("--checkpoint-at %v: give a fraction between 0 and 1", o.CheckpointAt)
	}
	if o.Tasks == "" {
		o.Tasks = "builtin"
	}
	if o.TokenDelay == 0 {
		o.TokenDelay = 2 * time.Millisecond
	}
	if o.Timeout == 0 {
		o.Timeout = 20 * time.Minute
	}
	if o.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		o.Exe = exe
	}
	if o.Progress == nil {
		o.Progress = nopProgress{}
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Nodes > 1 {
		switch {
		case o.Store == "" || o.Blobs == "":
			return fmt.Errorf("--nodes %d: the nodes share a PostgreSQL store and an S3 bucket: give --store postgres://… and --blobs s3://… (or STASIS_STORE and STASIS_BLOBS)", o.Nodes)
		case !sandbox.KeepsBlobs(o.Provider):
			return fmt.Errorf("--nodes: the %s provider's snapshots are not in the shared --blobs: use --provider local or microvm", o.Provider)
		case o.Nodes > 16:
			return fmt.Errorf("--nodes %d: at most 16 on one machine", o.Nodes)
		}
	}
	return nil
}

// hostedProvider says whether a provider's sandboxes run elsewhere (a
// service's), not on this machine.
func hostedProvider(name string) bool { return sandbox.IsHosted(name) }

// openHosted opens the named hosted provider as the server does, from the
// environment (the serve child's); close it when done.
func openHosted(name string) (sandbox.Provider, func() error, error) {
	if !sandbox.IsHosted(name) {
		return nil, nil, fmt.Errorf("%q is not a hosted provider", name)
	}
	p, err := sandbox.Open(context.Background(), name, sandbox.Config{})
	if err != nil {
		return nil, nil, err
	}
	return p, p.Close, nil
}

// crashHosted deletes, through the service, every sandbox of the run's
// episodes: on a hosted provider a crash takes the sandboxes with it only
// if someone deletes them, and the restore has nothing live to refuse.
func crashHosted(ctx context.Context, name string) (int, error) {
	p, closeP, err := openHosted(name)
	if err != nil {
		return 0, err
	}
	defer closeP()
	sbs, err := p.List(ctx, nil)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, sb := range sbs {
		if sb.Labels["stasis.episode"] == "" {
			continue
		}
		if err := p.Delete(ctx, sb.ID); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// crashSandboxes kills every sandbox of either provider under the state
// directory, as a crash of the machine would.
func crashSandboxes(state string) (int, error) {
	n, err := local.Crash(filepath.Join(state, "local"))
	if err != nil {
		return n, err
	}
	m, err := microvm.Crash(filepath.Join(state, "microvm"))
	return n + m, err
}

func pause(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d): // poll interval
		return nil
	}
}

type nopProgress struct{}

func (nopProgress) Phase(string, int) {}
func (nopProgress) Set(int)           {}
func (nopProgress) Done()             {}

// server is a `stasis serve` child and its address.
type server struct {
	cmd *exec.Cmd
	api *client.Client
	log *os.File
}

// startServer starts `stasis serve` on the state directory and waits for
// its address.
func startServer(ctx context.Context, o Options, modelURL string) (*server, error) {
	logf, err := os.OpenFile(filepath.Join(o.State, "serve.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(o.Exe, serveArgs(o, modelURL)...)
	cmd.Env = append(os.Environ(), o.ExeEnv...)
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start stasis serve: %w", err)
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			addr <- strings.TrimSpace(sc.Text())
		}
		close(addr)
		_, _ = io.Copy(io.Discard, out)
	}()
	s := &server{cmd: cmd, log: logf}
	// A default image is pulled (and unpacked, the first time) before the
	// server listens.
	startWait := 60 * time.Second
	if o.Image != "" {
		startWait = 10 * time.Minute
	}
	select {
	case a, ok := <-addr:
		if !ok || a == "" {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			logf.Close()
			tail, _ := os.ReadFile(logf.Name())
			return nil, fmt.Errorf("stasis serve did not start; its log:\n%s", lastLines(tail, 20))
		}
		if s.api, err = client.New("http://" + a); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			logf.Close()
			return nil, err
		}
	case <-time.After(startWait):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		logf.Close()
		return nil, fmt.Errorf("stasis serve did not print its address within %s", startWait)
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		logf.Close()
		return nil, ctx.Err()
	}
	return s, nil
}

// serveArgs are the arguments of `stasis serve` for the run.
func serveArgs(o Options, modelURL string) []string {
	args := []string{"serve", "--listen", "127.0.0.1:0", "--state", o.State, "--tasks", o.Tasks, "--model-upstream", modelURL, "--log-format", "json", "--provider", o.Provider}
	if o.GuestBinary != "" {
		args = append(args, "--guest-binary", o.GuestBinary)
	}
	if o.GuestMemory != "" {
		args = append(args, "--guest-memory", o.GuestMemory)
	}
	if o.Image != "" {
		// The restore after a crash must find it too: pull it again if
		// the store lost it.
		args = append(args, "--image", o.Image, "--pull-images")
	}
	if hostedProvider(o.Provider) {
		// The sandboxes are elsewhere: the gateway listens on TCP too.
		listen := o.GatewayListen
		if listen == "" {
			listen = "127.0.0.1:0"
		}
		args = append(args, "--gateway-listen", listen)
		if o.GatewayURL != "" {
			args = append(args, "--gateway-url", o.GatewayURL)
		}
	}
	if o.Repos != "" {
		args = append(args, "--repos", o.Repos)
	}
	if o.Envs != "" {
		args = append(args, "--envs", o.Envs)
	}
	if o.node != "" {
		args = append(args, "--node", o.node, "--node-lease", nodeLease.String(), "--store", o.Store, "--blobs", o.Blobs)
	}
	return args
}

func lastLines(b []byte, n int) string {
	ls := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// fleet is what the run's phases ask of its server, or of its nodes.
type fleet interface {
	// episodes lists every episode.
	episodes(ctx context.Context) ([]episodeView, error)
	// apiOf is the API that drives episode id.
	apiOf(ctx context.Context, id string) (*client.Client, error)
}

func (s *server) apiOf(context.Context, string) (*client.Client, error) { return s.api, nil }

func (s *server) episodes(ctx context.Context) ([]episodeView, error) {
	l, err := s.api.Episodes(ctx, client.ListOptions{})
	if err != nil {
		return nil, err
	}
	sort.Slice(l, func(i, j int) bool { return l[i].ID < l[j].ID })
	return l, nil
}

// cleanup retires every episode through the server (deleting their
// sandboxes), stops the server, and kills any sandbox still there.
func cleanup(s *server, o Options) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var errs []error
	if s != nil && s.cmd.ProcessState == nil {
		if views, err := s.episodes(ctx); err == nil {
			for _, v := range views {
				if v.State != store.EpisodeRetired {
					if _, err := s.api.Retire(ctx, v.ID); err != nil {
						errs = append(errs, err)
					}
				}
			}
		}
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- s.cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = s.cmd.Process.Kill()
			<-done
		}
		s.log.Close()
	}
	// Nothing may outlive the run.
	if n, err := crashSandboxes(o.State); err != nil {
		errs = append(errs, err)
	} else if n > 0 {
		o.Log.Warn("killed sandboxes the server left", "n", n)
	}
	if hostedProvider(o.Provider) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if n, err := crashHosted(ctx, o.Provider); err != nil {
			errs = append(errs, err)
		} else if n > 0 {
			o.Log.Info("deleted the run's sandboxes on the service", "n", n)
		}
	}
	return errors.Join(errs...)
}
