package supervisor

import (
	"bytes"
	"encoding/json"
	"fmt"

	"stasis/errdefs"
	"stasis/internal/proc"
)

// Mode is how a pause holds the harness.
type Mode string

const (
	// ModeStop pauses by SIGSTOP to every process of the harness tree and
	// continues by SIGCONT. It is the default: a file-only snapshot needs the
	// harness frozen.
	ModeStop Mode = "stop"
	// ModeHold sends no signal; the pause is acknowledged at once and the
	// relay holds the harness's model calls. It needs a snapshot that is
	// atomic over processes.
	ModeHold Mode = "hold"
	// ModeHoldFreeze holds as ModeHold does and also freezes the harness
	// tree with the cgroup v2 freezer: unlike SIGSTOP the processes cannot
	// see it, and a snapshot keeps no stopped state. It needs a writable
	// cgroup v2 file system (the microVM guest has one).
	ModeHoldFreeze Mode = "hold+freeze"
)

// ParseMode accepts "stop", "hold" or "hold+freeze".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case ModeStop, ModeHold, ModeHoldFreeze:
		return Mode(s), nil
	}
	return "", fmt.Errorf("unknown pause mode %q: use stop, hold or hold+freeze", s)
}

// Holds says whether a pause in this mode holds the harness's model calls
// rather than stopping it (hold and hold+freeze): the harness keeps its
// state in memory, and only a snapshot that keeps processes keeps it.
func (m Mode) Holds() bool { return m == ModeHold || m == ModeHoldFreeze }

// Operations of the control protocol.
const (
	OpPause    = "pause"
	OpContinue = "continue"
	OpStatus   = "status"
	OpStop     = "stop"
)

// MaxRequestBytes bounds one control request.
const MaxRequestBytes = 4096

// Request is one control message: a single JSON object on one line.
type Request struct {
	Op  string `json:"op"`
	Seq int64  `json:"seq,omitempty"`
}

// ParseRequest parses and validates one control request. Unknown fields are
// ignored so that a newer host can talk to an older supervisor.
func ParseRequest(b []byte) (Request, error) {
	var r Request
	if len(b) > MaxRequestBytes {
		return r, fmt.Errorf("request of %d bytes is over the %d-byte limit", len(b), MaxRequestBytes)
	}
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return r, fmt.Errorf("empty request: send one JSON object such as {\"op\":\"status\"}")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var raw map[string]json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return r, fmt.Errorf("malformed request: %v", err)
	}
	if dec.More() {
		return r, fmt.Errorf("malformed request: more than one JSON value")
	}
	opRaw, ok := raw["op"]
	if !ok {
		return r, fmt.Errorf("request has no \"op\": use pause, continue, status or stop")
	}
	if err := json.Unmarshal(opRaw, &r.Op); err != nil {
		return r, fmt.Errorf("\"op\" must be a string: %v", err)
	}
	switch r.Op {
	case OpPause, OpContinue:
		seqRaw, ok := raw["seq"]
		if !ok {
			return r, fmt.Errorf("%s needs \"seq\", a positive integer", r.Op)
		}
		var n json.Number
		if len(seqRaw) == 0 || seqRaw[0] < '0' || seqRaw[0] > '9' {
			return r, fmt.Errorf("\"seq\" must be a positive integer, got %s", truncate(seqRaw))
		}
		if err := json.Unmarshal(seqRaw, &n); err != nil {
			return r, fmt.Errorf("\"seq\" must be a positive integer, got %s", truncate(seqRaw))
		}
		v, err := n.Int64()
		if err != nil || v <= 0 {
			return r, fmt.Errorf("\"seq\" must be a positive integer, got %s", truncate(seqRaw))
		}
		r.Seq = v
	case OpStatus, OpStop:
	default:
		return r, fmt.Errorf("unknown op %q: use pause, continue, status or stop", truncate([]byte(r.Op)))
	}
	return r, nil
}

func truncate(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "..."
	}
	return string(b)
}

// Ack is the acknowledgement of a pause or a continue. It is what a
// checkpoint records about the pause.
type Ack struct {
	Seq       int64         `json:"seq"`
	Op        string        `json:"op"`
	Mode      Mode          `json:"mode"`
	Identity  proc.Identity `json:"identity"`
	Wall      float64       `json:"wall"`   // unix seconds when the acknowledgement was written
	Uptime    float64       `json:"uptime"` // seconds since boot, from /proc/uptime
	Confirmed bool          `json:"confirmed"`
	// Frozen is set on a hold+freeze pause's acknowledgement when the
	// freezer confirmed the whole harness tree frozen.
	Frozen bool `json:"frozen,omitempty"`
	// Relaunched is set on continue acknowledgements only: true when the
	// continue started the harness again because its pause was not confirmed.
	Relaunched *bool `json:"relaunched,omitempty"`
	// RelayDelivered is the number of model calls the relay had delivered to
	// the harness when the pause took hold; present when a relay is attached.
	RelayDelivered *int64 `json:"relay_delivered,omitempty"`
	// RelayPosition is the ledger position up to which every recorded
	// response was settled (delivered, or abandoned by a client that had
	// gone) when the pause took hold: where an in-place restore cuts the
	// ledger. Absent from older acknowledgements, where it equals
	// RelayDelivered.
	RelayPosition *int64 `json:"relay_position,omitempty"`
	// RelayUnmatched: the relay, relaunched from a saved session, had had
	// no answer yet when the pause took hold, so RelayDelivered and
	// RelayPosition (0) do not say where in the ledger its harness is: an
	// in-place restore matches the harness's next call against the ledger
	// instead of cutting it.
	RelayUnmatched bool `json:"relay_unmatched,omitempty"`
	HarnessPID     int  `json:"harness_pid,omitempty"`
	// DeadlineLeft is the run budget left, in seconds (paused time does not
	// count); absent without a deadline.
	DeadlineLeft *float64 `json:"deadline_left_s,omitempty"`
	// Note says why a pause was not confirmed.
	Note string `json:"note,omitempty"`
}

// Status answers the status request.
type Status struct {
	State        State         `json:"state"` // running, paused, stopping, exited
	Mode         Mode          `json:"mode"`
	Seq          int64         `json:"seq"` // last pause sequence number, 0 before any
	Confirmed    *bool         `json:"confirmed,omitempty"`
	Identity     proc.Identity `json:"identity"`
	HarnessPID   int           `json:"harness_pid"`
	Relaunches   int           `json:"relaunches"`
	Frozen       bool          `json:"frozen,omitempty"` // the harness's control group is frozen
	DeadlineLeft *float64      `json:"deadline_left_s"`  // null when there is no deadline
	PausedTotal  float64       `json:"paused_total_s"`
	Receipt      *Receipt      `json:"receipt,omitempty"`
}

// Receipt is written to DIR/receipt.json when the supervisor ends.
type Receipt struct {
	Identity proc.Identity `json:"identity"`
	// Mode and Seq are the launch's pause mode and its last pause number
	// (absent from receipts written before they were recorded).
	Mode             Mode  `json:"mode,omitempty"`
	Seq              int64 `json:"seq,omitempty"`
	CleanupConfirmed bool  `json:"cleanup_confirmed"`
	// ReturnCode is the harness's exit code, or minus the signal number when
	// a signal ended it; null when the harness never ran.
	ReturnCode  *int    `json:"return_code"`
	TimedOut    bool    `json:"timed_out"`
	Stopped     bool    `json:"stopped"` // ended by a stop request or signal to the supervisor
	Relaunches  int     `json:"relaunches"`
	Error       string  `json:"error"`
	PausedTotal float64 `json:"paused_total_s"`
	Wall        float64 `json:"wall"`
	Leftover    []int   `json:"leftover_pids,omitempty"` // processes that could not be killed
}

// Response is the one line the supervisor writes back for each request.
type Response struct {
	OK      bool     `json:"ok"`
	Error   string   `json:"error,omitempty"`
	Code    string   `json:"code,omitempty"`
	Ack     *Ack     `json:"ack,omitempty"`
	Status  *Status  `json:"status,omitempty"`
	Receipt *Receipt `json:"receipt,omitempty"`
}

// Error codes in responses.
const (
	CodeRefused = "refused" // the request is well formed but the state forbids it
	CodeInvalid = "invalid" // the request is malformed
	CodeDenied  = "denied"  // the peer is not allowed to talk to this supervisor
	CodeFailed  = "failed"  // the supervisor tried and failed
	// CodeUnreachable is `stasis ctl`'s own: no supervisor answered (no
	// control socket that accepts, and no receipt).
	CodeUnreachable = "unreachable"
)

// RefusedError is returned when a request is well formed but not allowed in
// the supervisor's present state. Nothing changes.
type RefusedError struct {
	Msg    string
	Status Status
}

func (e *RefusedError) Error() string { return e.Msg }

// Is makes a refusal a conflict in package errdefs's vocabulary.
func (e *RefusedError) Is(target error) bool { return target == errdefs.ErrConflict }
