package supervisor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"stasis/internal/proc"
)

// Process is the process layer the machine drives. The real one (procLayer)
// launches the harness through the shim and signals its tree; tests hand in
// a scripted one.
type Process interface {
	// Launch starts the harness with argv and returns its PID. gen numbers
	// the launch; the harness's exit is reported with the same number.
	Launch(gen int, argv []string) (pid int, err error)
	// StopTree sends SIGSTOP to every process of the harness tree and waits
	// up to timeout until each shows stopped. It returns false and a note
	// naming the stragglers when the tree did not stop in time.
	StopTree(timeout time.Duration) (confirmed bool, note string, err error)
	// ContTree sends SIGCONT to every process StopTree stopped.
	ContTree() error
	// FreezeTree freezes the harness's control group (cgroup v2) and waits
	// up to timeout for the kernel to confirm it frozen; like StopTree it
	// returns false and a note when it was not confirmed in time.
	FreezeTree(timeout time.Duration) (confirmed bool, note string, err error)
	// ThawTree undoes FreezeTree.
	ThawTree() error
	// Terminate asks the harness to end (SIGTERM to its process group).
	Terminate() error
	// KillTree kills every process below the supervisor and waits until all
	// are reaped. It returns the PIDs it could not get rid of.
	KillTree() (leftover []int, err error)
}

// Gate is the seam through which a pause holds the model relay. Hold returns
// once no delivery to the harness is under way and none will start, with
// what the relay has handed over so far; Release lets calls proceed again.
// Flush has the gateway record what became of every response so far (the
// supervisor calls it when the harness has ended, before its receipt, so
// an ended episode's ledger has no response left pending).
type Gate interface {
	Hold() (Held, error)
	Release() error
	Flush(ctx context.Context) error
}

// Held is what a relay reports when a pause holds it.
type Held struct {
	// Delivered counts the responses the harness received whole.
	Delivered int64
	// Position is the ledger position up to which every recorded response
	// is settled, delivered or abandoned by a client that had gone: the
	// point an in-place restore cuts the ledger to. It is Delivered plus
	// the abandoned responses before it.
	Position int64
	// Unmatched: the relay was relaunched from a saved session and has had
	// no answer since, so it does not know where in the ledger its harness
	// resumes; Delivered and Position are 0 and say nothing of it. A
	// restore in place must have the gateway match the harness's next call
	// against the ledger instead of cutting the ledger at Position.
	Unmatched bool
}

// Clock gives the machine its time. Monotonic readings drive the deadline;
// Wall and Uptime stamp acknowledgements.
type Clock interface {
	Now() time.Time
	Wall() float64
	Uptime() float64
}

// Config is what the supervisor was started with.
type Config struct {
	Argv               []string
	ResumeArgv         []string // relaunch command; Argv when empty
	Mode               Mode
	Deadline           time.Duration // run budget; 0 means none
	Grace              time.Duration // SIGTERM to SIGKILL
	StopConfirmTimeout time.Duration
}

// The machine's states. Each is a value of type stateName; operations switch
// on it and say plainly why they are refused.
type stateName int

const (
	stRunning           stateName = iota
	stPausedStop                  // whole tree stopped by SIGSTOP
	stPausedHold                  // acknowledged, no signal sent (frozen in hold+freeze)
	stPausedUnconfirmed           // tree did not stop in time and was killed
	stStopping                    // SIGTERM sent (deadline or stop), waiting for exit
	stExited
)

// State is a supervisor's public state, as a Status reports it.
type State string

// The public states.
const (
	StateRunning  State = "running"
	StatePaused   State = "paused"
	StateStopping State = "stopping"
	StateExited   State = "exited"
)

func (s stateName) public() State {
	switch s {
	case stRunning:
		return StateRunning
	case stPausedStop, stPausedHold, stPausedUnconfirmed:
		return StatePaused
	case stStopping:
		return StateStopping
	}
	return StateExited
}

func (s stateName) describe() string {
	switch s {
	case stRunning:
		return "running"
	case stPausedStop:
		return "paused (stop mode, confirmed)"
	case stPausedHold:
		return "paused (hold mode)"
	case stPausedUnconfirmed:
		return "paused (stop not confirmed; the harness was killed and relaunches on continue)"
	case stStopping:
		return "stopping"
	}
	return "exited"
}

// Machine is the supervisor's state machine: pause, continue, deadline,
// stop and harness exit. It is not safe for concurrent use; the server
// serialises every call. It performs side effects only through Process,
// Gate and Clock, so tests step it deterministically.
type Machine struct {
	cfg   Config
	id    proc.Identity
	p     Process
	gate  Gate
	clock Clock

	state      stateName
	gen        int // launch generation
	harnessPID int
	relaunches int

	lastPause int64
	pauseAck  *Ack // acknowledgement of the last pause
	contAck   *Ack // acknowledgement of the continue of the last pause, once done

	used         time.Duration // budget used by completed running intervals
	runningSince time.Time
	pausedTotal  time.Duration
	pausedSince  time.Time

	stopReason string    // "deadline" or "stop"
	killAt     time.Time // end of the grace period while stopping
	killed     bool
	leftover   []int // processes that survived the kill of an unconfirmed pause
	frozen     bool  // the harness's control group is frozen (hold+freeze)
	receipt    *Receipt
}

// NewMachine makes a machine; Start launches the harness.
func NewMachine(cfg Config, id proc.Identity, p Process, gate Gate, clock Clock) *Machine {
	if cfg.Mode == "" {
		cfg.Mode = ModeStop
	}
	return &Machine{cfg: cfg, id: id, p: p, gate: gate, clock: clock}
}

// Clone returns a copy of the machine in its present state that drives p,
// gate and clock instead of the original's: what a memory snapshot of the
// sandbox holds, for a provider that keeps its sandboxes' processes in
// memory (the simulated provider). The copy and the original go on
// independently; like the machine, Clone must not run concurrently with
// another call on it.
func (m *Machine) Clone(p Process, gate Gate, clock Clock) *Machine {
	c := *m
	c.p, c.gate, c.clock = p, gate, clock
	c.cfg.Argv = append([]string(nil), m.cfg.Argv...)
	c.cfg.ResumeArgv = append([]string(nil), m.cfg.ResumeArgv...)
	c.leftover = append([]int(nil), m.leftover...)
	// Acknowledgements and the receipt are not changed once made, but a
	// copy shares nothing it could.
	if m.pauseAck != nil {
		a := *m.pauseAck
		c.pauseAck = &a
	}
	if m.contAck != nil {
		a := *m.contAck
		c.contAck = &a
	}
	if m.receipt != nil {
		r := *m.receipt
		c.receipt = &r
	}
	return &c
}

// Start launches the harness for the first time.
func (m *Machine) Start() error {
	m.gen++
	pid, err := m.p.Launch(m.gen, m.cfg.Argv)
	if err != nil {
		m.finish(nil, fmt.Sprintf("launch %q: %v", m.cfg.Argv[0], err), nil, nil)
		return err
	}
	m.harnessPID = pid
	m.runningSince = m.clock.Now()
	return nil
}

// Exited reports whether the machine has ended; Receipt is then final.
func (m *Machine) Exited() bool { return m.state == stExited }

// Receipt returns the receipt once the machine has exited.
func (m *Machine) Receipt() *Receipt { return m.receipt }

func (m *Machine) refuse(format string, args ...any) error {
	return &RefusedError{Msg: fmt.Sprintf(format, args...) + "; supervisor is " + m.state.describe() + m.seqText(), Status: m.Status()}
}

func (m *Machine) seqText() string {
	if m.lastPause == 0 {
		return ", no pause yet"
	}
	return fmt.Sprintf(", last pause %d", m.lastPause)
}

func (m *Machine) ack(op string, seq int64, confirmed bool) *Ack {
	return &Ack{
		Seq:          seq,
		Op:           op,
		Mode:         m.cfg.Mode,
		Identity:     m.id,
		Wall:         m.clock.Wall(),
		Uptime:       m.clock.Uptime(),
		Confirmed:    confirmed,
		HarnessPID:   m.harnessPID,
		DeadlineLeft: m.deadlineLeft(),
	}
}

// deadlineLeft is the run budget left, in seconds; nil without a deadline.
func (m *Machine) deadlineLeft() *float64 {
	if m.cfg.Deadline <= 0 {
		return nil
	}
	left := max((m.cfg.Deadline - m.usedNow()).Seconds(), 0)
	return &left
}

// Pause handles "pause seq". The returned bool is true when the
// acknowledgement is new (and must be written to disk), false when it repeats
// an earlier one.
func (m *Machine) Pause(seq int64) (*Ack, bool, error) {
	switch m.state {
	case stPausedStop, stPausedHold, stPausedUnconfirmed:
		if seq == m.lastPause {
			return m.pauseAck, false, nil
		}
		return nil, false, m.refuse("pause %d refused: pause %d is in force; continue %d first", seq, m.lastPause, m.lastPause)
	case stStopping, stExited:
		return nil, false, m.refuse("pause %d refused: the harness is ending", seq)
	}
	if seq <= m.lastPause {
		return nil, false, m.refuse("pause %d refused: a pause must be numbered above the last one (%d)", seq, m.lastPause)
	}
	now := m.clock.Now()
	m.used += now.Sub(m.runningSince)
	m.pausedSince = now

	var held *Held
	if m.gate != nil {
		h, err := m.gate.Hold()
		if err != nil {
			m.runningSince = m.clock.Now()
			return nil, false, fmt.Errorf("pause %d: hold the relay: %w", seq, err)
		}
		held = &h
	}

	confirmed, note := true, ""
	next := stPausedHold
	if m.cfg.Mode == ModeStop || m.cfg.Mode == ModeHoldFreeze {
		next, confirmed, note = m.stopOrFreeze()
	}
	m.state = next
	m.lastPause = seq
	m.contAck = nil
	a := m.ack(OpPause, seq, confirmed)
	a.Frozen = m.frozen && next == stPausedHold
	if held != nil {
		a.RelayDelivered, a.RelayPosition = &held.Delivered, &held.Position
		a.RelayUnmatched = held.Unmatched
	}
	a.Note = note
	m.pauseAck = a
	return a, true, nil
}

// stopOrFreeze stops (stop mode) or freezes (hold+freeze) the harness
// tree for a pause; a tree not confirmed stopped or frozen in time is
// killed, to be relaunched on continue. note says what happened.
func (m *Machine) stopOrFreeze() (next stateName, confirmed bool, note string) {
	var err error
	if m.cfg.Mode == ModeStop {
		next = stPausedStop
		confirmed, note, err = m.p.StopTree(m.cfg.StopConfirmTimeout)
	} else {
		// A process in uninterruptible sleep delays a freeze as it
		// delays a stop: the same bound, the same outcome.
		next = stPausedHold
		confirmed, note, err = m.p.FreezeTree(m.cfg.StopConfirmTimeout)
		m.frozen = true
	}
	if err != nil {
		confirmed, note = false, err.Error()
	}
	if confirmed {
		return next, true, note
	}
	left, err := m.p.KillTree()
	m.leftover = left
	switch {
	case err != nil:
		note += "; killing the tree failed: " + err.Error()
	case len(left) > 0:
		note += fmt.Sprintf("; %d processes survived SIGKILL: %v", len(left), left)
	default:
		note += "; the harness tree was killed and will be relaunched on continue"
	}
	if m.frozen {
		// The relaunch must not start in a frozen group.
		if err := m.p.ThawTree(); err != nil {
			note += "; thawing its control group failed: " + err.Error()
		} else {
			m.frozen = false
		}
	}
	m.harnessPID = 0
	return stPausedUnconfirmed, false, note
}

// Continue handles "continue seq".
func (m *Machine) Continue(seq int64) (*Ack, bool, error) {
	switch m.state {
	case stRunning, stStopping, stExited:
		if seq == m.lastPause && m.contAck != nil {
			return m.contAck, false, nil
		}
		if m.state != stRunning {
			return nil, false, m.refuse("continue %d refused: the harness is ending", seq)
		}
		return nil, false, m.refuse("continue %d refused: no pause is in force", seq)
	}
	if seq != m.lastPause {
		return nil, false, m.refuse("continue %d refused: the pause in force is %d", seq, m.lastPause)
	}
	relaunched := false
	var err error
	switch m.state {
	case stPausedStop:
		err = m.p.ContTree()
	case stPausedHold:
		if m.frozen {
			if err = m.p.ThawTree(); err == nil {
				m.frozen = false
			}
		}
	case stPausedUnconfirmed:
		argv := m.cfg.ResumeArgv
		if len(argv) == 0 {
			argv = m.cfg.Argv
		}
		m.gen++
		var pid int
		pid, err = m.p.Launch(m.gen, argv)
		if err == nil {
			m.harnessPID = pid
			m.relaunches++
			relaunched = true
		} else {
			err = fmt.Errorf("relaunch %q: %w", argv[0], err)
		}
	}
	if m.gate != nil {
		if gerr := m.gate.Release(); gerr != nil && err == nil {
			err = fmt.Errorf("release the relay: %w", gerr)
		}
	}
	now := m.clock.Now()
	m.pausedTotal += now.Sub(m.pausedSince)
	m.runningSince = now
	if err != nil {
		if relaunched || m.state != stPausedUnconfirmed {
			// The harness runs; report the failure but go on.
			m.state = stRunning
		} else {
			m.finish(nil, err.Error(), m.leftover, nil)
		}
		a := m.ack(OpContinue, seq, false)
		a.Relaunched = &relaunched
		a.Note = err.Error()
		m.contAck = a
		return a, true, nil
	}
	m.state = stRunning
	a := m.ack(OpContinue, seq, true)
	a.Relaunched = &relaunched
	m.contAck = a
	return a, true, nil
}

// Status describes the machine now.
func (m *Machine) Status() Status {
	s := Status{
		State:      m.state.public(),
		Mode:       m.cfg.Mode,
		Seq:        m.lastPause,
		Identity:   m.id,
		HarnessPID: m.harnessPID,
		Relaunches: m.relaunches,
		Receipt:    m.receipt,
		Frozen:     m.frozen,
	}
	if m.pauseAck != nil && m.state.public() == StatePaused {
		c := m.pauseAck.Confirmed
		s.Confirmed = &c
	}
	paused := m.pausedTotal
	if m.state.public() == StatePaused {
		paused += m.clock.Now().Sub(m.pausedSince)
	}
	s.PausedTotal = paused.Seconds()
	s.DeadlineLeft = m.deadlineLeft()
	return s
}

func (m *Machine) usedNow() time.Duration {
	if m.state == stRunning || m.state == stStopping {
		return m.used + m.clock.Now().Sub(m.runningSince)
	}
	return m.used
}

// NextWake says when Tick must next be called: the deadline while running,
// the end of the grace period while stopping. Zero means no timer is needed.
func (m *Machine) NextWake() time.Time {
	switch m.state {
	case stRunning:
		if m.cfg.Deadline > 0 {
			return m.runningSince.Add(m.cfg.Deadline - m.used)
		}
	case stStopping:
		if !m.killed {
			return m.killAt
		}
	}
	return time.Time{}
}

// Tick acts on the clock: it starts the deadline's graceful end when the
// budget is spent, and kills the tree when the grace period is over.
func (m *Machine) Tick() {
	now := m.clock.Now()
	switch m.state {
	case stRunning:
		if m.cfg.Deadline > 0 && m.usedNow() >= m.cfg.Deadline {
			m.beginStop("deadline")
		}
	case stStopping:
		if !m.killed && !now.Before(m.killAt) {
			m.killed = true
			_, _ = m.p.KillTree()
		}
	}
}

func (m *Machine) beginStop(reason string) {
	m.stopReason = reason
	wasPaused := m.state == stPausedStop
	if m.state.public() == StatePaused {
		m.pausedTotal += m.clock.Now().Sub(m.pausedSince)
	}
	m.state = stStopping
	m.runningSince = m.clock.Now()
	m.killAt = m.clock.Now().Add(m.cfg.Grace)
	_ = m.p.Terminate()
	if wasPaused {
		// The SIGTERM is pending on a stopped tree; let it be delivered.
		_ = m.p.ContTree()
	}
	if m.frozen {
		// Likewise on a frozen one.
		if m.p.ThawTree() == nil {
			m.frozen = false
		}
	}
	if m.gate != nil {
		_ = m.gate.Release()
	}
}

// Stop begins a graceful end, as at the deadline: SIGTERM to the harness,
// then SIGKILL to the tree after the grace period. The receipt comes when the
// harness has exited (HarnessExited).
func (m *Machine) Stop() {
	switch m.state {
	case stStopping, stExited:
		return
	case stPausedUnconfirmed:
		// Nothing runs: end now.
		m.pausedTotal += m.clock.Now().Sub(m.pausedSince)
		m.stopReason = "stop"
		m.finish(nil, "", m.leftover, nil)
		return
	}
	m.beginStop("stop")
}

// ErrStaleLaunch is returned by HarnessExited for the exit of a launch the
// machine has already given up on (killed on an unconfirmed pause).
var ErrStaleLaunch = errors.New("exit of an earlier launch")

// HarnessExited reports that launch gen's harness ended with the given
// return code (minus the signal number when a signal ended it). The machine
// kills what is left of the tree and exits.
func (m *Machine) HarnessExited(gen int, code int) error {
	if gen != m.gen || m.state == stPausedUnconfirmed || m.state == stExited {
		return ErrStaleLaunch
	}
	if m.state.public() == StatePaused {
		m.pausedTotal += m.clock.Now().Sub(m.pausedSince)
	}
	left, err := m.p.KillTree()
	m.finish(&code, "", left, err)
	return nil
}

func (m *Machine) finish(code *int, errMsg string, leftover []int, cleanupErr error) {
	if m.state == stExited {
		return
	}
	if m.gate != nil && m.state.public() == StatePaused {
		_ = m.gate.Release()
	}
	m.state = stExited
	m.receipt = &Receipt{
		Identity:         m.id,
		Mode:             m.cfg.Mode,
		Seq:              m.lastPause,
		CleanupConfirmed: len(leftover) == 0 && cleanupErr == nil,
		ReturnCode:       code,
		TimedOut:         m.stopReason == "deadline",
		Stopped:          m.stopReason == "stop",
		Relaunches:       m.relaunches,
		Error:            errMsg,
		PausedTotal:      m.pausedTotal.Seconds(),
		Wall:             m.clock.Wall(),
		Leftover:         leftover,
	}
	if cleanupErr != nil {
		if errMsg != "" {
			errMsg += "; "
		}
		m.receipt.Error = errMsg + "cleanup: " + cleanupErr.Error()
	}
}
