package task

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"stasis/sandbox"
	"stasis/store"
)

// Verdict is the result of verifying one episode: the reward and what it
// rests on.
type Verdict struct {
	Episode string `json:"episode"`
	Task    string `json:"task"`
	// Reward is 1 when every FAIL_TO_PASS test passed and no PASS_TO_PASS
	// test broke, else 0.
	Reward int `json:"reward"`
	// FailToPass and PassToPass give each listed test's outcome (passed,
	// failed, skipped, missing).
	FailToPass map[string]string `json:"fail_to_pass"`
	PassToPass map[string]string `json:"pass_to_pass"`
	ExitCode   int               `json:"exit_code"`
	TimedOut   bool              `json:"timed_out,omitempty"`
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
	f2p, p2p = map[string]string{}, map[string]string{}
	reward = 1
	for _, n := range t.FailToPass {
		o, ok := got[n]
		if !ok {
			o = Missing
		}
		f2p[n] = o
		if o != Passed {
			reward = 0
		}
	}
	for _, n := range t.PassToPass {
		o, ok := got[n]
		if !ok {
			o = Missing
		}
		p2p[n] = o
		// A skipped PASS_TO_PASS test did not break.
		if o != Passed && o != Skipped {
			reward = 0
		}
	}
	return reward, f2p, p2p
}

// RunTests runs the task's test command in a sandbox's work tree and
// evaluates it. An error means the tests could not be run (the sandbox is
// gone, say), not that they failed.
func RunTests(ctx context.Context, p sandbox.Provider, sandboxID string, t *Task) (Verdict, error) {
	var out bytes.Buffer
	w := &syncWriter{w: &out}
	start := time.Now()
	v := Verdict{Task: t.ID, Started: start.UTC()}
	res, err := p.Exec(ctx, sandboxID, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", t.TestCmd}, Cwd: WorkDir, Env: t.EnvMap(),
		Stdout: w, Stderr: w, Timeout: t.Budget(),
	})
	v.DurationS = time.Since(start).Seconds()
	switch {
	case errors.Is(err, sandbox.ErrTimeout):
		v.TimedOut, v.ExitCode = true, -9
	case err != nil:
		return Verdict{}, fmt.Errorf("task %s: run the tests in sandbox %s: %w", t.ID, sandboxID, err)
	default:
		v.ExitCode = res.ExitCode
	}
	o := out.String()
	v.OutputBytes = len(o)
	if len(o) > OutputLimit {
		o = o[len(o)-OutputLimit:]
	}
	v.Output = o
	v.Reward, v.FailToPass, v.PassToPass = t.Evaluate(out.String())
	if v.TimedOut {
		v.Reward = 0
	}
	return v, nil
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

// VerdictStore keeps each episode's verdict once (store.Store does).
type VerdictStore interface {
	PutVerdict(ctx context.Context, episode string, doc json.RawMessage) (stored json.RawMessage, created bool, err error)
	GetVerdict(ctx context.Context, episode string) (json.RawMessage, error)
}

// Verifier verifies episodes once: the first verify of an episode runs its
// tests and records the verdict; every later one, also from another
// Verifier on the same store (after a restore or a server restart),
// returns the recorded verdict without running anything.
type Verifier struct {
	Store    VerdictStore
	Provider sandbox.Provider

	mu    sync.Mutex
	locks map[string]*sync.Mutex
}

// ErrNotEnded refuses a verify while the harness may still change the work
// tree.
var ErrNotEnded = errors.New("the harness has not ended")

func (v *Verifier) lock(episode string) *sync.Mutex {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.locks == nil {
		v.locks = map[string]*sync.Mutex{}
	}
	l, ok := v.locks[episode]
	if !ok {
		l = &sync.Mutex{}
		v.locks[episode] = l
	}
	return l
}

// Recorded returns an episode's recorded verdict; ok is false when none is
// recorded yet.
func (v *Verifier) Recorded(ctx context.Context, episode string) (Verdict, bool, error) {
	doc, err := v.Store.GetVerdict(ctx, episode)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return Verdict{}, false, nil
		}
		return Verdict{}, false, err
	}
	var vd Verdict
	if err := json.Unmarshal(doc, &vd); err != nil {
		return Verdict{}, false, fmt.Errorf("episode %s: the recorded verdict is unreadable: %w", episode, err)
	}
	return vd, true, nil
}

// Verify returns the episode's verdict. When one is recorded it is returned
// with recorded true, and nothing runs. Otherwise ended is asked first: it
// must confirm that the harness has ended and its cleanup is confirmed
// (else Verify refuses with its error, wrapped in ErrNotEnded); then the
// tests run in the sandbox and the verdict is recorded. Two verifies of one
// episode at once run the tests once.
func (v *Verifier) Verify(ctx context.Context, episode, sandboxID string, t *Task, ended func(context.Context) error) (Verdict, bool, error) {
	if vd, ok, err := v.Recorded(ctx, episode); err != nil || ok {
		return vd, ok, err
	}
	l := v.lock(episode)
	l.Lock()
	defer l.Unlock()
	if vd, ok, err := v.Recorded(ctx, episode); err != nil || ok {
		return vd, ok, err
	}
	if ended != nil {
		if err := ended(ctx); err != nil {
			return Verdict{}, false, fmt.Errorf("episode %s: verify: %w: %v", episode, ErrNotEnded, err)
		}
	}
	vd, err := RunTests(ctx, v.Provider, sandboxID, t)
	if err != nil {
		return Verdict{}, false, fmt.Errorf("episode %s: verify: %w", episode, err)
	}
	vd.Episode = episode
	doc, err := json.Marshal(vd)
	if err != nil {
		return Verdict{}, false, err
	}
	stored, created, err := v.Store.PutVerdict(ctx, episode, doc)
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
