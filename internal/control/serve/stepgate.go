package serve

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// StepGateEnv, set in a server's environment to a directory DIR, has the
// server stop at a step of its checkpoint protocol for a test that kills
// a party there (the kill matrix): at the step (the coordinator's step
// hook, or a provider's snapshot while it is being written) it creates
// DIR/SEQ-OP-STEP-EPISODE.reached and waits until DIR/SEQ-OP-STEP-EPISODE.go
// appears (polling, for at most StepGateTimeout), then goes on. Only the
// first step StepGateAtEnv names is stopped at; every other step passes.
// For tests: a server without it set has no gate.
const StepGateEnv = "STASIS_STEP_GATE"

// StepGateAtEnv names the one step a StepGateEnv gate stops at, as
// OP:STEP or OP:STEP:EPISODE (e.g. prepare:commit, restore:go:ep-1,
// serve:listening just before `stasis serve` prints its address,
// provider:snapshot-writing); unset, the gate stops at nothing.
const StepGateAtEnv = "STASIS_STEP_GATE_AT"

// StepGateTimeout is how long a gate waits for its .go file before it
// lets the step pass (logging it): a gate never holds a server forever.
const StepGateTimeout = 5 * time.Minute

// StepGate stops a server once at one step (StepGateEnv).
type StepGate struct {
	dir              string
	op, step, ep     string
	log              *slog.Logger
	timeout, polling time.Duration

	mu   sync.Mutex
	seq  int
	done bool // it stopped once
}

// StepGateFromEnv is the gate StepGateEnv and StepGateAtEnv describe, or
// nil when StepGateEnv is not set.
func StepGateFromEnv(log *slog.Logger) (*StepGate, error) {
	dir := os.Getenv(StepGateEnv)
	if dir == "" {
		return nil, nil
	}
	g := &StepGate{dir: dir, log: log, timeout: StepGateTimeout, polling: 20 * time.Millisecond}
	if at := os.Getenv(StepGateAtEnv); at != "" {
		parts := strings.SplitN(at, ":", 3)
		if len(parts) < 2 || parts[0] == "" || parts[1] == "" {
			return nil, fmt.Errorf("%s=%q: give OP:STEP or OP:STEP:EPISODE, such as prepare:commit", StepGateAtEnv, at)
		}
		g.op, g.step = parts[0], parts[1]
		if len(parts) == 3 {
			g.ep = parts[2]
		}
	} else {
		g.done = true // nothing named: every step passes
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("%s: %w", StepGateEnv, err)
	}
	return g, nil
}

// Step is the gate at step (op, step, episode): the coordinator's step
// hook. It never fails the step: a gate that times out lets it pass.
func (g *StepGate) Step(op, step, episode string) error {
	g.mu.Lock()
	if g.done || op != g.op || step != g.step || (g.ep != "" && episode != g.ep) {
		g.mu.Unlock()
		return nil
	}
	g.done = true
	g.seq++
	name := fmt.Sprintf("%d-%s-%s-%s", g.seq, op, step, episode)
	g.mu.Unlock()
	base := filepath.Join(g.dir, name)
	if err := os.WriteFile(base+".reached", []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644); err != nil {
		g.log.Warn("step gate: cannot mark the step reached; passing it", "step", name, "err", err)
		return nil
	}
	g.log.Info("step gate: stopped", "step", name)
	deadline := time.Now().Add(g.timeout)
	for {
		if _, err := os.Stat(base + ".go"); err == nil {
			g.log.Info("step gate: going on", "step", name)
			return nil
		}
		if time.Now().After(deadline) {
			g.log.Warn("step gate: no .go file in time; passing the step", "step", name, "waited", g.timeout)
			return nil
		}
		time.Sleep(g.polling) // poll interval, bounded by the deadline above
	}
}

// Snapshot is the gate inside a provider's snapshot of sandbox while it
// is being written (sandbox.Config.SnapshotHook): the step
// provider:snapshot-writing:SANDBOX.
func (g *StepGate) Snapshot(sandbox string) error {
	return g.Step("provider", "snapshot-writing", sandbox)
}
