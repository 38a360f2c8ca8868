package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Record kinds, the "kind" field of every line.
const (
	kindHeader = "ledger" // first line of every file: names the episode
	kindEntry  = "entry"  // one model call
	kindCut    = "cut"    // the logical ledger becomes its first "to" entries
	kindBroken = "broken" // the episode's history cannot be trusted from here on
)

// formatVersion is the "format" of the header line this code writes and reads.
const formatVersion = 1

// hashLen is the length of a record hash: SHA-256, lowercase hex.
const hashLen = 2 * sha256.Size

// hashKey starts the last field of every line: the hash is the last field,
// so the bytes it covers are exactly the line with its 64 hex digits taken
// out.
var hashKey = []byte(`"hash":"`)

// record is one line of a ledger file. Entry fields are inline; control
// records use kind, to, reason, boundary and at. Hash must stay the last
// field: the encoder relies on it.
type record struct {
	Kind     string          `json:"kind"`
	Format   int             `json:"format,omitempty"`
	Episode  string          `json:"episode,omitempty"`
	Seq      int64           `json:"seq,omitempty"`
	CallID   string          `json:"call_id,omitempty"`
	Attempt  int             `json:"attempt,omitempty"`
	Request  json.RawMessage `json:"request,omitempty"`
	Response json.RawMessage `json:"response,omitempty"`
	Usage    json.RawMessage `json:"usage,omitempty"`
	Tokens   *Tokens         `json:"tokens,omitempty"`
	Started  time.Time       `json:"started,omitzero"`
	Finished time.Time       `json:"finished,omitzero"`
	To       *int64          `json:"to,omitempty"`
	Reason   string          `json:"reason,omitempty"`
	Boundary bool            `json:"boundary,omitempty"`
	At       time.Time       `json:"at,omitzero"`
	Parent   string          `json:"parent"`
	Hash     string          `json:"hash"`
}

func entryRecord(e Entry) record {
	return record{
		Kind: kindEntry, Seq: e.Seq, CallID: e.CallID, Attempt: e.Attempt,
		Request: e.Request, Response: e.Response, Usage: e.Usage, Tokens: e.Tokens,
		Started: e.Started, Finished: e.Finished, Boundary: e.Boundary,
		Parent: e.Parent, Hash: e.Hash,
	}
}

func (r record) entry() Entry {
	return Entry{
		Seq: r.Seq, CallID: r.CallID, Attempt: r.Attempt, Parent: r.Parent,
		Request: r.Request, Response: r.Response, Usage: r.Usage, Tokens: r.Tokens,
		Started: r.Started, Finished: r.Finished, Boundary: r.Boundary, Hash: r.Hash,
	}
}

// encodeRecord returns r's line, without the newline, with its hash filled
// in (r.Hash is ignored). The hash is SHA-256 over the line as written with
// an empty hash value.
func encodeRecord(r record) ([]byte, string, error) {
	r.Hash = ""
	b, err := json.Marshal(r)
	if err != nil {
		return nil, "", fmt.Errorf("encode %s record: %w", r.Kind, err)
	}
	if !bytes.HasSuffix(b, []byte(`,"hash":""}`)) {
		return nil, "", fmt.Errorf("encode %s record: hash is not the last field", r.Kind)
	}
	sum := sha256.Sum256(b)
	h := hex.EncodeToString(sum[:])
	line := make([]byte, 0, len(b)+hashLen)
	line = append(line, b[:len(b)-2]...)
	line = append(line, h...)
	line = append(line, `"}`...)
	return line, h, nil
}

// errHash is the decoder's complaint about a hash that does not cover the
// line: the line was changed after it was written.
var errHash = errors.New("hash mismatch: the record was changed after it was written")

// decodeRecord parses one line (without its newline) and checks that it is
// well formed and that its hash covers it. It does not check the parent link
// or the sequence number: those depend on the lines before it. On a hash
// mismatch the record is returned too, for the error report only.
func decodeRecord(line []byte) (record, error) {
	var r record
	// The line must end with "hash":"<64 lowercase hex>"}.
	n := len(line)
	tail := len(hashKey) + hashLen + 2
	if n < tail+1 || line[0] != '{' || !bytes.HasSuffix(line, []byte(`"}`)) ||
		!bytes.Equal(line[n-tail:n-tail+len(hashKey)], hashKey) ||
		(line[n-tail-1] != ',' && line[n-tail-1] != '{') {
		return r, errors.New(`not a ledger record: a line must be a JSON object ending with "hash":"<64 hex digits>"}`)
	}
	want := line[n-2-hashLen : n-2]
	for _, c := range want {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return r, errors.New("not a ledger record: the hash must be 64 lowercase hex digits")
		}
	}
	if err := json.Unmarshal(line, &r); err != nil {
		return record{}, fmt.Errorf("not a ledger record: %w", err)
	}
	if r.Hash != string(want) {
		return record{}, errors.New(`not a ledger record: "hash" must be the last field`)
	}
	pre := make([]byte, 0, n-hashLen)
	pre = append(pre, line[:n-2-hashLen]...)
	pre = append(pre, `"}`...)
	sum := sha256.Sum256(pre)
	if hex.EncodeToString(sum[:]) != r.Hash {
		return r, errHash // r, though not to be trusted, says which record it is
	}
	if err := r.check(); err != nil {
		return record{}, err
	}
	return r, nil
}

// check validates the fields a record of its kind needs.
func (r record) check() error {
	if r.Parent != "" && !isHash(r.Parent) {
		return fmt.Errorf("%s record: parent %q is not a record hash", r.Kind, r.Parent)
	}
	switch r.Kind {
	case kindHeader:
		if r.Format != formatVersion {
			return fmt.Errorf("ledger header: format %d; this stasis reads format %d (a newer stasis wrote it?)", r.Format, formatVersion)
		}
		if err := checkEpisode(r.Episode); err != nil {
			return fmt.Errorf("ledger header: %w", err)
		}
	case kindEntry:
		if r.Seq < 1 {
			return fmt.Errorf("entry record: seq %d must be at least 1", r.Seq)
		}
		if r.CallID == "" {
			return fmt.Errorf("entry record %d: empty call_id", r.Seq)
		}
		if len(r.Response) == 0 {
			return fmt.Errorf("entry record %d: no response", r.Seq)
		}
	case kindCut:
		if r.To == nil || *r.To < 0 {
			return errors.New(`cut record: "to" must be a position of at least 0`)
		}
	case kindBroken:
		if r.Reason == "" {
			return errors.New("broken record: no reason")
		}
	default:
		return fmt.Errorf("unknown record kind %q (written by a newer stasis?)", r.Kind)
	}
	return nil
}

func isHash(s string) bool {
	if len(s) != hashLen {
		return false
	}
	for _, c := range []byte(s) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
