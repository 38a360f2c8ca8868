package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strings"

	"stasis/errdefs"
	"stasis/internal/proc"
)

// RecordSchema is the version of the record document this stasis writes.
// A record of a higher schema is refused, never half-read.
const RecordSchema = 1

// Pause modes a record can name.
const (
	PauseStop       = "stop"
	PauseHold       = "hold"
	PauseHoldFreeze = "hold+freeze"
)

// Identity is a supervisor's identity: its PID and its start time in clock
// ticks since boot. It is proc.Identity, so that an acknowledgement's
// identity goes into a record unchanged.
type Identity = proc.Identity

// Record is what a checkpoint keeps about one episode: where its snapshot is,
// how it was paused, and what a restore needs to continue it in place or to
// relaunch it. It is stored as its JSON document.
//
// Compatibility: a document without keeps_processes reads as false; one
// without pause_wall or pause_uptime restores by relaunch; fields this stasis
// does not know are kept, unchanged, through a read and a write; schema 0 or
// an absent schema reads as schema 1 (the first schema had no schema field).
type Record struct {
	Schema         int             `json:"schema"`
	Episode        string          `json:"episode"`
	Provider       string          `json:"provider"`
	Sandbox        json.RawMessage `json:"sandbox"`         // the provider's sandbox descriptor
	SnapshotID     string          `json:"snapshot_id"`     // empty only for a finished episode
	KeepsProcesses bool            `json:"keeps_processes"` // the snapshot holds the processes (absent reads as false)
	PauseSeq       int64           `json:"pause_seq"`
	PauseMode      string          `json:"pause_mode"` // stop | hold, or empty when no pause was made
	PauseConfirmed bool            `json:"pause_confirmed"`
	// PauseFrozen: the harness tree was frozen (hold+freeze) when the
	// snapshot was taken; the continue after an in-place restore thaws it.
	PauseFrozen    bool      `json:"pause_frozen,omitempty"`
	Identity       *Identity `json:"identity,omitempty"`     // the supervisor's {pid, start_time}
	PauseWall      *float64  `json:"pause_wall,omitempty"`   // unix seconds at the pause
	PauseUptime    *float64  `json:"pause_uptime,omitempty"` // seconds since boot at the pause
	RelayDelivered *int64    `json:"relay_delivered,omitempty"`
	// RelayPosition is the ledger position the relay had settled at the
	// pause (delivered or abandoned responses): the in-place cut. Older
	// records lack it; their cut is RelayDelivered.
	RelayPosition *int64 `json:"relay_position,omitempty"`
	// RelayUnmatched: the relay had not learned its ledger position at the
	// pause (relaunched, no answer since): RelayPosition says nothing, and
	// an in-place restore matches the harness's next call against the
	// ledger instead of cutting it. Absent reads as false.
	RelayUnmatched bool `json:"relay_unmatched,omitempty"`
	// LedgerHead is the hash of the ledger's entry at the cut ("" at 0, and
	// in older records): an in-place restore checks that the ledger still
	// holds that entry there.
	LedgerHead string `json:"ledger_head,omitempty"`
	// LedgerTip is the hash of the ledger's last record when the snapshot
	// was taken ("" in older records): a restore of this checkpoint takes
	// the ledger back there (a branch) when it has moved on past it.
	LedgerTip      string          `json:"ledger_tip,omitempty"`
	HarnessSession string          `json:"harness_session,omitempty"`
	Attempt        int             `json:"attempt"`
	DeadlineLeftS  *float64        `json:"deadline_left_s,omitempty"`
	Finished       bool            `json:"finished,omitempty"`
	Result         json.RawMessage `json:"result,omitempty"` // verify result of a finished episode
	// Image is the digest of the image the episode's sandbox ran on
	// (local, microvm), which a restore needs; ImageRef is the reference
	// it was pulled as, from which a missing image can be pulled again.
	Image    string `json:"image,omitempty"`
	ImageRef string `json:"image_ref,omitempty"`

	// unknown holds the fields DecodeRecord did not recognise, compacted,
	// so that MarshalJSON writes them back.
	unknown map[string]json.RawMessage
}

// recordFields is Record without its methods, for encoding/json.
type recordFields Record

// knownNames are the JSON names of Record's fields.
var knownNames = func() []string {
	var names []string
	t := reflect.TypeFor[recordFields]()
	for i := range t.NumField() {
		tag := t.Field(i).Tag.Get("json")
		if name, _, _ := strings.Cut(tag, ","); name != "" && name != "-" {
			names = append(names, name)
		}
	}
	return names
}()

// isKnown reports whether encoding/json would decode key into one of
// Record's fields; it matches names as encoding/json does, ignoring case
// under Unicode simple folding.
func isKnown(key string) bool {
	for _, n := range knownNames {
		if strings.EqualFold(key, n) {
			return true
		}
	}
	return false
}

// RestoresInPlace reports whether a restore can continue the episode in
// place: the snapshot kept processes and the record has the supervisor's
// identity and the pause's clocks. Otherwise a restore relaunches the harness.
func (r Record) RestoresInPlace() bool {
	return r.KeepsProcesses && r.Identity != nil && r.PauseWall != nil && r.PauseUptime != nil
}

// Unknown returns the names of the fields the record was read with that this
// stasis does not know, sorted. They are written back unchanged.
func (r Record) Unknown() []string {
	names := make([]string, 0, len(r.unknown))
	for k := range r.unknown {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

// MarshalJSON writes the record's document: its fields, then the unknown
// fields it was read with. A Record whose Schema is 0 is written as
// RecordSchema.
func (r Record) MarshalJSON() ([]byte, error) {
	f := recordFields(r)
	if f.Schema == 0 {
		f.Schema = RecordSchema
	}
	if len(f.Sandbox) == 0 {
		f.Sandbox = nil
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(f); err != nil {
		return nil, fmt.Errorf("record of episode %q: %w", r.Episode, err)
	}
	out := bytes.TrimRight(buf.Bytes(), "\n")
	if len(r.unknown) == 0 {
		return out, nil
	}
	out = out[:len(out)-1] // drop the closing brace
	for _, k := range r.Unknown() {
		key, err := json.Marshal(k)
		if err != nil {
			return nil, err
		}
		out = append(out, ',')
		out = append(out, key...)
		out = append(out, ':')
		out = append(out, r.unknown[k]...)
	}
	return append(out, '}'), nil
}

// ErrRecord marks a record document that is malformed or fails validation;
// it is invalid input.
var ErrRecord = errdefs.Errorf(errdefs.ErrInvalid, "invalid record")

// DecodeRecord reads and validates one record document. It refuses malformed
// JSON, a schema newer than RecordSchema, and records that a restore could
// not use (no episode, no provider, no snapshot for an unfinished episode, an
// unknown pause mode, negative counters).
func DecodeRecord(b []byte) (Record, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return Record{}, fmt.Errorf("%w: not a JSON object: %v", ErrRecord, err)
	}
	if fields == nil {
		return Record{}, fmt.Errorf("%w: the document is null, not an object", ErrRecord)
	}
	var f recordFields
	if err := json.Unmarshal(b, &f); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return Record{}, fmt.Errorf("%w: field %q must be a JSON %s, not %s", ErrRecord, te.Field, te.Type, te.Value)
		}
		return Record{}, fmt.Errorf("%w: %v", ErrRecord, err)
	}
	r := Record(f)
	for k, v := range fields {
		if isKnown(k) {
			continue
		}
		var c bytes.Buffer
		if err := json.Compact(&c, v); err != nil {
			return Record{}, fmt.Errorf("%w: field %q: %v", ErrRecord, k, err)
		}
		if r.unknown == nil {
			r.unknown = make(map[string]json.RawMessage)
		}
		r.unknown[k] = c.Bytes()
	}
	r.Sandbox = normaliseRaw(r.Sandbox)
	r.Result = normaliseRaw(r.Result)
	if r.Schema == 0 {
		r.Schema = RecordSchema
	}
	if err := r.validate(); err != nil {
		return Record{}, err
	}
	return r, nil
}

// normaliseRaw compacts a raw JSON value and reads a JSON null as absent.
func normaliseRaw(v json.RawMessage) json.RawMessage {
	if len(v) == 0 {
		return nil
	}
	var c bytes.Buffer
	if json.Compact(&c, v) != nil {
		return v
	}
	if c.String() == "null" {
		return nil
	}
	return c.Bytes()
}

// validate checks a record for what a restore relies on; r.Schema is
// already normalised.
func (r Record) validate() error {
	who := "record"
	if r.Episode != "" {
		who = fmt.Sprintf("record of episode %q", r.Episode)
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrRecord, who, fmt.Sprintf(format, a...))
	}
	switch {
	case r.Schema > RecordSchema:
		return bad("schema %d is newer than this stasis understands (up to %d): upgrade stasis to read it", r.Schema, RecordSchema)
	case r.Schema < 0:
		return bad("schema %d is not a schema: it must be a positive integer (1)", r.Schema)
	case r.Episode == "":
		return bad(`"episode" is missing or empty`)
	case r.Provider == "":
		return bad(`"provider" is missing or empty: name the sandbox provider that made the snapshot`)
	case r.SnapshotID == "" && !r.Finished:
		return bad(`"snapshot_id" is missing or empty: an unfinished episode needs its snapshot`)
	case r.PauseMode != "" && r.PauseMode != PauseStop && r.PauseMode != PauseHold && r.PauseMode != PauseHoldFreeze:
		return bad(`"pause_mode" %q is unknown: use %q, %q or %q`, r.PauseMode, PauseStop, PauseHold, PauseHoldFreeze)
	case r.PauseFrozen && r.PauseMode != PauseHoldFreeze:
		return bad(`"pause_frozen" is set on a %q pause: only a hold+freeze pause freezes`, r.PauseMode)
	case r.PauseSeq < 0:
		return bad(`"pause_seq" %d is negative`, r.PauseSeq)
	case r.Attempt < 0:
		return bad(`"attempt" %d is negative`, r.Attempt)
	case r.Identity != nil && r.Identity.PID <= 0:
		return bad(`"identity" has pid %d: a pid is positive`, r.Identity.PID)
	case r.RelayDelivered != nil && *r.RelayDelivered < 0:
		return bad(`"relay_delivered" %d is negative`, *r.RelayDelivered)
	case r.RelayPosition != nil && *r.RelayPosition < 0:
		return bad(`"relay_position" %d is negative`, *r.RelayPosition)
	case r.RelayPosition != nil && r.RelayDelivered != nil && *r.RelayPosition < *r.RelayDelivered:
		return bad(`"relay_position" %d is below "relay_delivered" %d: every delivered response is settled`, *r.RelayPosition, *r.RelayDelivered)
	}
	for _, c := range []struct {
		name string
		v    *float64
	}{{"pause_wall", r.PauseWall}, {"pause_uptime", r.PauseUptime}, {"deadline_left_s", r.DeadlineLeftS}} {
		if c.v != nil && (*c.v < 0 || math.IsNaN(*c.v) || math.IsInf(*c.v, 0)) {
			return bad("%q %v must be a non-negative number of seconds", c.name, *c.v)
		}
	}
	return nil
}
