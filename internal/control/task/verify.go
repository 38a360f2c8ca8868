package task

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Verdict statuses.
const (
	// StatusResolved: every FAIL_TO_PASS test passed and no PASS_TO_PASS
	// test broke (reward 1).
	StatusResolved = "resolved"
	// StatusUnresolved: the tests ran and judged the work tree; some
	// listed test did not pass (reward 0).
	StatusUnresolved = "unresolved"
	// StatusError: the tests could not judge the work tree (they timed
	// out, could not be collected or imported, or the runner failed);
	// Reason says why. The reward is 0, but it is not the model's failure
	// unless the reason says so.
	StatusError = "error"
)

// Verdict is the result of verifying one attempt of an episode: the
// status, the reward and what they rest on.
type Verdict struct {
	Episode string `json:"episode"`
	// Attempt is the episode's attempt that was verified: a restore starts
	// a new one, verified afresh.
	Attempt int    `json:"attempt"`
	Task    string `json:"task"`
	// Status is resolved, unresolved or error; Reason says why for error
	// (and for unresolved when a test run failed as a whole).
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
	// Reward is 1 when resolved, else 0.
	Reward int `json:"reward"`
	// FailToPass and PassToPass give each listed test's outcome (passed,
	// failed, skipped, missing).
	FailToPass map[string]string `json:"fail_to_pass"`
	PassToPass map[string]string `json:"pass_to_pass"`
	// Environment is what the tests ran in (see task.Environment).
	Environment string `json:"environment,omitempty"`
	// TestsRestored counts the test files restored from the task before
	// the run.
	TestsRestored int `json:"tests_restored"`
	// TestsRemoved are test files the agent added, removed before the run;
	// TestsReverted test files of the task it changed, restored.
	TestsRemoved  []string `json:"tests_removed,omitempty"`
	TestsReverted []string `json:"tests_reverted,omitempty"`
	ExitCode      int      `json:"exit_code"`
	TimedOut      bool     `json:"timed_out,omitempty"`
	// Output is the test command's combined output, cut to its last
	// OutputLimit bytes when longer (OutputBytes is the whole length).
	Output      string    `json:"output"`
	OutputBytes int       `json:"output_bytes"`
	Started     time.Time `json:"started"`
	DurationS   float64   `json:"duration_s"`
}

// OutputLimit is how much test output a verdict keeps.
const OutputLimit = 256 << 10

// Evaluate turns a test run's output into per-test outcomes and a reward.
func (t *Task) Evaluate(output string) (reward int, f2p, p2p map[string]string) {
	got := Parsers[t.Parser](output)
	f2p, okF := outcomes(got, t.FailToPass, Passed)
	// A skipped PASS_TO_PASS test did not break.
	p2p, okP := outcomes(got, t.PassToPass, Passed, Skipped)
	if okF && okP {
		reward = 1
	}
	return reward, f2p, p2p
}

// outcomes are the outcomes of the tests named (Missing for one the output
// does not give); ok says whether each is one of good.
func outcomes(got map[string]string, names []string, good ...string) (out map[string]string, ok bool) {
	out, ok = map[string]string{}, true
	for _, n := range names {
		o, found := got[n]
		if !found {
			o = Missing
		}
		out[n] = o
		if !slices.Contains(good, o) {
			ok = false
		}
	}
	return out, ok
}

// pytestExits are pytest's exit codes that mean the tests were not run as
// a whole (1 is "some tests failed").
var pytestExits = map[int]string{
	2: "the run was interrupted (pytest exit 2: a collection or import error)",
	3: "pytest had an internal error (exit 3)",
	4: "pytest was called wrongly (exit 4: a usage error, or a test file it cannot find)",
	5: "pytest collected no tests (exit 5)",
}

var importErrorRE = regexp.MustCompile(`(?m)^E?\s*(ModuleNotFoundError|ImportError|SyntaxError|IndentationError)\b.*$`)

// judge sets the verdict's status and reason from its outcomes, exit code
// and output.
func (t *Task) judge(v *Verdict, output string) {
	ran := 0
	for _, o := range v.FailToPass {
		if o != Missing {
			ran++
		}
	}
	for _, o := range v.PassToPass {
		if o != Missing {
			ran++
		}
	}
	listed := len(v.FailToPass) + len(v.PassToPass)
	switch {
	case v.TimedOut:
		v.Status, v.Reason = StatusError, fmt.Sprintf("the tests ran past the task's budget of %s and were killed", t.Budget())
	case strings.HasPrefix(t.Parser, "pytest") && pytestExits[v.ExitCode] != "" && ran < listed:
		v.Status, v.Reason = StatusError, pytestExits[v.ExitCode]
	case ran == 0 && listed > 0:
		v.Status, v.Reason = StatusError, fmt.Sprintf("none of the %d listed tests ran (exit %d)", listed, v.ExitCode)
	case v.Reward == 1:
		v.Status = StatusResolved
	default:
		v.Status = StatusUnresolved
	}
	if v.Status == StatusError {
		if m := importErrorRE.FindString(output); m != "" {
			v.Reason += "; the output says: " + strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(m), "E "))
		}
		v.Reward = 0
	}
}

// RunTests restores the task's tests in a sandbox's work tree (ResetTests),
// runs its test command there and judges the result. An error means the
// tests could not be run (the sandbox is gone, say), not that they failed.
func RunTests(ctx context.Context, p sandbox.Files, sandboxID string, t *Task) (Verdict, error) {
	return runTests(ctx, p, sandboxID, t, runOptions{})
}

// runOptions are what a Verifier adds to a test run.
type runOptions struct {
	// seed is a tar stream file of a Go build cache made by a trusted run
	// (goSeed), unpacked into the run's fresh GOCACHE before the tests.
	seed string
	// capture, when set, is where the run's GOCACHE is written as a tar
	// stream after the tests.
	capture io.Writer
}

func runTests(ctx context.Context, p sandbox.Files, sandboxID string, t *Task, o runOptions) (Verdict, error) {
	env, err := t.Environment(ctx)
	if err != nil {
		return Verdict{}, err
	}
	start := time.Now()
	v := Verdict{Task: t.ID, Started: start.UTC(), Environment: env.String()}
	r, err := ResetTests(ctx, p, sandboxID, t)
	if err != nil {
		return Verdict{}, err
	}
	v.TestsRestored, v.TestsRemoved, v.TestsReverted = r.Restored, r.Removed, r.Reverted
	var out bytes.Buffer
	w := &syncWriter{w: &out}
	venv, home := t.VerifyEnv()
	// The run's home is made afresh: mkdir fails on anything already there.
	var mk bytes.Buffer
	if res, err := p.Exec(ctx, sandboxID, sandbox.ExecRequest{Argv: []string{"mkdir", "-m", "700", "--", home}, Stdout: &mk, Stderr: &mk}); err != nil || res.ExitCode != 0 {
		return Verdict{}, fmt.Errorf("task %s: make the test run's home %s in sandbox %s: %v (exit %d) %s", t.ID, home, sandboxID, err, res.ExitCode, strings.TrimSpace(mk.String()))
	}
	cache, ownCache := venv["GOCACHE"], t.Env["GOCACHE"] == ""
	if o.seed != "" && ownCache {
		if err := uploadFile(ctx, p, sandboxID, cache, o.seed); err != nil {
			// Slower, not wrong: the tests build what the seed had.
			slog.Warn("the Go build cache seed could not be unpacked; the tests build without it", "task", t.ID, "sandbox", sandboxID, "err", err)
		}
	}
	res, err := p.Exec(ctx, sandboxID, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", t.TestCmd}, Cwd: WorkDir, Env: venv,
		Stdout: w, Stderr: w, Timeout: t.Budget(),
	})
	v.DurationS = time.Since(start).Seconds()
	if err == nil && o.capture != nil && ownCache {
		if derr := p.Download(ctx, sandboxID, cache, o.capture); derr != nil {
			return Verdict{}, fmt.Errorf("task %s: keep the Go build cache of sandbox %s: %w", t.ID, sandboxID, derr)
		}
	}
	if err == nil {
		// The run's home (its caches, tens of MB for Go) is not left in
		// the sandbox's /tmp for a snapshot to copy.
		if res, rerr := p.Exec(ctx, sandboxID, sandbox.ExecRequest{Argv: []string{"rm", "-rf", "--", home}}); rerr != nil || res.ExitCode != 0 {
			slog.Debug("the test run's home was not removed", "task", t.ID, "sandbox", sandboxID, "home", home, "err", rerr)
		}
	}
	switch {
	case errors.Is(err, errdefs.ErrTimeout):
		v.TimedOut, v.ExitCode = true, -9
	case err != nil:
		return Verdict{}, fmt.Errorf("task %s: run the tests in sandbox %s: %w", t.ID, sandboxID, err)
	default:
		v.ExitCode = res.ExitCode
	}
	text := out.String()
	v.OutputBytes = len(text)
	if len(text) > OutputLimit {
		text = text[len(text)-OutputLimit:]
	}
	v.Output = text
	v.Reward, v.FailToPass, v.PassToPass = t.Evaluate(out.String())
	t.judge(&v, out.String())
	return v, nil
}

// VerifyEnv is the environment the tests run with at verify: the task's
// (EnvMap), with a home of the run's own (returned; it must not exist yet)
// in place of the agent's, where the tools keep their caches and settings.
// The agent may have written anything into its home and the work tree: a
// Go build cache whose entries compile to other code than their sources,
// a go env file, Python's user site or byte code beside the sources. None
// of that is read: Go builds in a fresh GOCACHE with GOENV off, Python
// reads no user site and keeps byte code under the run's home
// (PYTHONPYCACHEPREFIX), and XDG's places are the run's. What the task
// itself sets is kept.
func (t *Task) VerifyEnv() (map[string]string, string) {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	home := "/tmp/.stasis-verify-" + hex.EncodeToString(b)
	env := t.EnvMap()
	for k, v := range map[string]string{
		"HOME":                home,
		"GOCACHE":             home + "/go-build",
		"GOENV":               "off",
		"PYTHONNOUSERSITE":    "1",
		"PYTHONPYCACHEPREFIX": home + "/pycache",
		"XDG_CACHE_HOME":      home + "/.cache",
		"XDG_CONFIG_HOME":     home + "/.config",
		"XDG_DATA_HOME":       home + "/.local/share",
	} {
		if _, set := t.Env[k]; !set {
			env[k] = v
		}
	}
	return env, home
}

type syncWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (s *syncWriter) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(b)
}

// VerdictStore keeps the verdict of each attempt of an episode once
// (store.Store does).
type VerdictStore interface {
	PutVerdict(ctx context.Context, episode string, attempt int, doc json.RawMessage) (stored json.RawMessage, created bool, err error)
	GetVerdict(ctx context.Context, episode string, attempt int) (json.RawMessage, error)
}

// Verifier verifies each attempt of an episode once: the first verify runs
// its tests and records the verdict; every later one, also from another
// Verifier on the same store (after a server restart), returns the
// recorded verdict without running anything. A restore starts a new
// attempt: the verdict of a run the restore discarded is never returned
// for the restored one.
type Verifier struct {
	Store    VerdictStore
	Provider sandbox.Provider
	// SeedDir, when set, keeps the Go build cache seeds of Go tasks (see
	// goSeed); empty: every Go verify builds from an empty cache.
	SeedDir string

	mu        sync.Mutex
	locks     map[string]*sync.Mutex
	baselines map[*Task]*baseline
	baseMu    sync.Mutex             // one baseline run at a time
	seedLocks map[string]*sync.Mutex // one per seed file
	seedAsks  map[string]int         // verifies that wanted each seed
}

// ErrNotEnded refuses a verify while the harness may still change the work
// tree. It is a conflict.
var ErrNotEnded = errdefs.Errorf(errdefs.ErrConflict, "the harness has not ended")

func (v *Verifier) lock(episode string, attempt int) *sync.Mutex {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.locks == nil {
		v.locks = map[string]*sync.Mutex{}
	}
	k := episode + "\x00" + strconv.Itoa(attempt)
	l, ok := v.locks[k]
	if !ok {
		l = &sync.Mutex{}
		v.locks[k] = l
	}
	return l
}

// Recorded returns the recorded verdict of an episode's attempt; ok is
// false when none is recorded yet.
func (v *Verifier) Recorded(ctx context.Context, episode string, attempt int) (Verdict, bool, error) {
	doc, err := v.Store.GetVerdict(ctx, episode, attempt)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return Verdict{}, false, nil
		}
		return Verdict{}, false, err
	}
	var vd Verdict
	if err := json.Unmarshal(doc, &vd); err != nil {
		return Verdict{}, false, fmt.Errorf("episode %s: the recorded verdict is unreadable: %w", episode, err)
	}
	if vd.Status == "" { // recorded before verdicts had a status
		vd.Status = StatusUnresolved
		if vd.Reward == 1 {
			vd.Status = StatusResolved
		}
	}
	return vd, true, nil
}

// baseline is how a task's tests fare on its own, unchanged work tree.
type baseline struct {
	done   bool
	status string
	reason string
}

// attribute decides whom a test run that failed as a whole is to blame:
// it runs the tests once per task on the task's unchanged work tree, in a
// sandbox of its own. When they run there, the agent's work broke the run
// and the verdict is unresolved (saying so); when they fail there too, the
// environment is broken and the verdict stays an error. Without a way to
// make that sandbox, the verdict stays an error.
func (v *Verifier) attribute(ctx context.Context, t *Task, vd *Verdict) {
	v.mu.Lock()
	if v.baselines == nil {
		v.baselines = map[*Task]*baseline{}
	}
	b, ok := v.baselines[t]
	if !ok {
		b = &baseline{}
		v.baselines[t] = b
	}
	v.mu.Unlock()
	v.baseMu.Lock()
	if !b.done {
		status, reason, err := v.runBaseline(ctx, t)
		if err != nil {
			v.baseMu.Unlock()
			vd.Reason += fmt.Sprintf("; whether the unchanged work tree runs could not be checked: %v", err)
			return
		}
		b.done, b.status, b.reason = true, status, reason
	}
	v.baseMu.Unlock()
	if b.status == StatusError {
		vd.Reason += "; the tests fail the same way on the task's unchanged work tree, so the environment is broken: " + b.reason
		return
	}
	vd.Status = StatusUnresolved
	vd.Reason = "the agent's work tree broke the test run: " + vd.Reason + " (on the unchanged work tree the tests run)"
}

func (v *Verifier) runBaseline(ctx context.Context, t *Task) (status, reason string, err error) {
	if _, err := t.Environment(ctx); err != nil {
		return "", "", err
	}
	tree, err := os.MkdirTemp("", "stasis-baseline-")
	if err != nil {
		return "", "", err
	}
	defer os.RemoveAll(tree)
	if err := t.Materialize(tree); err != nil {
		return "", "", err
	}
	info, err := v.Provider.Create(ctx, sandbox.Spec{
		Root: tree, Env: t.EnvMap(), Expiry: time.Now().Add(2*t.Budget() + 5*time.Minute),
		Labels: map[string]string{"stasis.task": t.ID, "stasis.role": "baseline"},
	})
	if err != nil {
		return "", "", err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := v.Provider.Delete(dctx, info.ID); err != nil {
			slog.Warn("the baseline run's sandbox could not be deleted", "task", t.ID, "sandbox", info.ID, "err", err)
		}
	}()
	bv, err := RunTests(ctx, v.Provider, info.ID, t)
	if err != nil {
		return "", "", err
	}
	return bv.Status, bv.Reason, nil
}

// NoModelCall is the error Verify's ended returns when the harness has
// ended without the episode ever making a model call: the model never
// acted, and its tests would only judge the task as it was given. Verify
// then records an error verdict whose reason is Reason, and runs no test:
// the failure is the environment's (a harness that could not start or
// resume, a model server that never answered), not the model's, and a
// trainer must not learn from it. The agent cannot bring it about: with
// no model call it has done nothing.
type NoModelCall struct{ Reason string }

func (n *NoModelCall) Error() string { return n.Reason }

// Verify returns the verdict of an episode's attempt. When one is
// recorded it is returned with recorded true, and nothing runs. Otherwise
// ended is asked first: it must confirm that the harness has ended and its
// cleanup is confirmed (else Verify refuses with its error, wrapped in
// ErrNotEnded), or say that the episode never made a model call
// (NoModelCall: the verdict is then an error, with no test run); then the
// tests are restored and run in the sandbox, a run that failed as a whole
// is attributed (see attribute), and the verdict is recorded. Two
// verifies of one attempt at once run the tests once.
func (v *Verifier) Verify(ctx context.Context, episode string, attempt int, sandboxID string, t *Task, ended func(context.Context) error) (Verdict, bool, error) {
	if vd, ok, err := v.Recorded(ctx, episode, attempt); err != nil || ok {
		return vd, ok, err
	}
	l := v.lock(episode, attempt)
	l.Lock()
	defer l.Unlock()
	if vd, ok, err := v.Recorded(ctx, episode, attempt); err != nil || ok {
		return vd, ok, err
	}
	var none *NoModelCall
	if ended != nil {
		if err := ended(ctx); err != nil && !errors.As(err, &none) {
			return Verdict{}, false, fmt.Errorf("episode %s: verify: %w: %v", episode, ErrNotEnded, err)
		}
	}
	var vd Verdict
	if none != nil {
		vd = Verdict{Task: t.ID, Status: StatusError, Reason: none.Reason,
			FailToPass: map[string]string{}, PassToPass: map[string]string{}, ExitCode: -1, Started: time.Now().UTC()}
	} else {
		var err error
		if vd, err = runTests(ctx, v.Provider, sandboxID, t, runOptions{seed: v.goSeed(ctx, t, false)}); err != nil {
			return Verdict{}, false, fmt.Errorf("episode %s: verify: %w", episode, err)
		}
		if vd.Status == StatusError && !vd.TimedOut {
			v.attribute(ctx, t, &vd)
		}
	}
	vd.Episode, vd.Attempt = episode, attempt
	doc, err := json.Marshal(vd)
	if err != nil {
		return Verdict{}, false, err
	}
	stored, created, err := v.Store.PutVerdict(ctx, episode, attempt, doc)
	if err != nil {
		return Verdict{}, false, fmt.Errorf("episode %s: record the verdict: %w", episode, err)
	}
	if !created {
		// Another process verified it first; its verdict stands.
		var first Verdict
		if err := json.Unmarshal(stored, &first); err != nil {
			return Verdict{}, false, fmt.Errorf("episode %s: the recorded verdict is unreadable: %w", episode, err)
		}
		return first, true, nil
	}
	return vd, false, nil
}
