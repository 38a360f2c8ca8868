package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
)

// Record kinds, the "kind" field of every line.
const (
	kindHeader = "ledger" // first line of every file: names the episode
	kindEntry  = "entry"  // one model call
	kindCut    = "cut"    // the logical ledger becomes its first "to" entries
	kindBroken = "broken" // the episode's history cannot be trusted from here on
	kindSettle = "settle" // the dispositions of live entries
	kindBranch = "branch" // the logical ledger goes back to what it was after record "from"
)

// formatVersion is the "format" of the header line this code writes: 2,
// entries start Pending and settle records give their dispositions. It
// reads formatVersion and formatV1 (no settle records when written, so an
// entry not settled reads as Delivered).
const (
	formatVersion = 2
	formatV1      = 1
)

// hashLen is the length of a record hash: SHA-256, lowercase hex.
const hashLen = 2 * sha256.Size

// hashKey starts the last field of every line: the hash is the last field,
// so the bytes it covers are exactly the line with its 64 hex digits taken
// out.
var hashKey = []byte(`"hash":"`)

// record is one line of a ledger file. Entry fields are inline; control
// records use kind, to, reason, boundary, settled and at. Hash must stay the last
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
	From     string          `json:"from,omitempty"`
	Settled  []Settlement    `json:"settled,omitempty"`
	At       time.Time       `json:"at,omitzero"`
	Parent   string          `json:"parent"`
	Hash     string          `json:"hash"`
	// canon: Request, Response and Usage are canonical already (Append
	// made them so), and are written as they are.
	canon bool
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
	line, h, err := appendRecordLine(nil, &r, false)
	return line, h, err
}

// appendRecordLine appends r's line (without the newline, with its hash) to
// dst and returns it and the hash. canon says r's raw JSON fields are
// already canonical (canonJSON's output), so they are copied as they are.
// The bytes are json.Marshal's (see encodeRecordJSON, which a test holds
// them to and which any value this encoder does not handle goes to).
func appendRecordLine(dst []byte, r *record, canon bool) ([]byte, string, error) {
	start := len(dst)
	b, ok := appendRecord(dst, r, canon)
	if !ok {
		line, h, err := encodeRecordJSON(*r)
		if err != nil {
			return dst, "", err
		}
		return append(dst, line...), h, nil
	}
	// b ends with "hash":""}: hash those bytes, then put the hash between
	// the quotes.
	sum := sha256.Sum256(b[start:])
	var h [hashLen]byte
	hex.Encode(h[:], sum[:])
	b = append(b[:len(b)-2], h[:]...)
	b = append(b, '"', '}')
	return b, string(h[:]), nil
}

// encodeRecordJSON is encodeRecord by encoding/json: the reference the fast
// encoder is tested against, and its fallback.
func encodeRecordJSON(r record) ([]byte, string, error) {
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

// appendRecord appends r as json.Marshal would write it with an empty hash:
// fields in the struct's order, omitempty and omitzero as tagged, strings
// with encoding/json's escaping. ok is false for a value it leaves to
// encoding/json (a float that is not finite, a time it cannot write, raw
// JSON that is not valid).
func appendRecord(b []byte, r *record, canon bool) (_ []byte, ok bool) {
	b = append(b, `{"kind":`...)
	b = appendString(b, r.Kind)
	if r.Format != 0 {
		b = append(b, `,"format":`...)
		b = strconv.AppendInt(b, int64(r.Format), 10)
	}
	if r.Episode != "" {
		b = append(b, `,"episode":`...)
		b = appendString(b, r.Episode)
	}
	if r.Seq != 0 {
		b = append(b, `,"seq":`...)
		b = strconv.AppendInt(b, r.Seq, 10)
	}
	if r.CallID != "" {
		b = append(b, `,"call_id":`...)
		b = appendString(b, r.CallID)
	}
	if r.Attempt != 0 {
		b = append(b, `,"attempt":`...)
		b = strconv.AppendInt(b, int64(r.Attempt), 10)
	}
	for _, f := range [...]struct {
		key string
		raw json.RawMessage
	}{{`,"request":`, r.Request}, {`,"response":`, r.Response}, {`,"usage":`, r.Usage}} {
		if len(f.raw) == 0 {
			continue
		}
		b = append(b, f.key...)
		if canon {
			b = append(b, f.raw...)
		} else if b, ok = appendCanon(b, f.raw); !ok {
			return b, false
		}
	}
	if r.Tokens != nil {
		if b, ok = appendTokens(append(b, `,"tokens":`...), r.Tokens); !ok {
			return b, false
		}
	}
	for _, f := range [...]struct {
		key string
		t   time.Time
	}{{`,"started":`, r.Started}, {`,"finished":`, r.Finished}} {
		if f.t.IsZero() {
			continue
		}
		if b, ok = appendTime(append(b, f.key...), f.t); !ok {
			return b, false
		}
	}
	if r.To != nil {
		b = append(b, `,"to":`...)
		b = strconv.AppendInt(b, *r.To, 10)
	}
	if r.Reason != "" {
		b = append(b, `,"reason":`...)
		b = appendString(b, r.Reason)
	}
	if r.Boundary {
		b = append(b, `,"boundary":true`...)
	}
	if r.From != "" {
		b = append(b, `,"from":`...)
		b = appendString(b, r.From)
	}
	if len(r.Settled) > 0 {
		b = appendSettled(append(b, `,"settled":`...), r.Settled)
	}
	if !r.At.IsZero() {
		if b, ok = appendTime(append(b, `,"at":`...), r.At); !ok {
			return b, false
		}
	}
	b = append(b, `,"parent":`...)
	b = appendString(b, r.Parent)
	return append(b, `,"hash":""}`...), true
}

// appendTokens appends t as json.Marshal would write it.
func appendTokens(b []byte, t *Tokens) (_ []byte, ok bool) {
	b = append(b, '{')
	n := len(b)
	if len(t.PromptIDs) > 0 {
		b = appendInts(append(b, `"prompt_token_ids":`...), t.PromptIDs)
	}
	if len(t.CompletionIDs) > 0 {
		if len(b) > n {
			b = append(b, ',')
		}
		b = appendInts(append(b, `"completion_token_ids":`...), t.CompletionIDs)
	}
	if len(t.Logprobs) > 0 {
		if len(b) > n {
			b = append(b, ',')
		}
		if b, ok = appendFloats(append(b, `"logprobs":`...), t.Logprobs); !ok {
			return b, false
		}
	}
	return append(b, '}'), true
}

// appendSettled appends settlements as json.Marshal would write them.
func appendSettled(b []byte, settled []Settlement) []byte {
	b = append(b, '[')
	for i, s := range settled {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(append(b, `{"seq":`...), s.Seq, 10)
		b = appendString(append(b, `,"call_id":`...), s.CallID)
		b = appendString(append(b, `,"disposition":`...), string(s.Disposition))
		b = append(b, '}')
	}
	return append(b, ']')
}

// appendString appends s as a JSON string the way encoding/json writes it
// (HTML characters escaped). Plain printable ASCII is copied; anything else
// is left to encoding/json.
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, _ := json.Marshal(s) // a string always marshals
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

func appendInts(b []byte, v []int64) []byte {
	b = append(b, '[')
	for i, x := range v {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, x, 10)
	}
	return append(b, ']')
}

// appendFloats writes floats as encoding/json does (ES6 number form); ok is
// false for NaN or an infinity, which it refuses.
func appendFloats(b []byte, v []float64) ([]byte, bool) {
	b = append(b, '[')
	for i, f := range v {
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return b, false
		}
		if i > 0 {
			b = append(b, ',')
		}
		if c, ok := appendMicros(b, f); ok {
			b = c
			continue
		}
		format := byte('f')
		if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
			format = 'e'
		}
		b = strconv.AppendFloat(b, f, format, -1, 64)
		if format == 'e' {
			// clean up e-09 to e-9
			n := len(b)
			if n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
				b[n-2] = b[n-1]
				b = b[:n-1]
			}
		}
	}
	return append(b, ']'), true
}

// appendMicros appends f as strconv.AppendFloat(b, f, 'f', -1, 64) does
// when f is a whole number of millionths (as a float64 parsed from such a
// decimal is: a logprob like -0.338788) between 1e-6 and 1e9; ok is false
// for any other f, which is left to strconv.
//
// m = f×10^6 rounded is below 10^15 < 2^53, so m and 10^6 are exact and
// m/10^6 is the correctly rounded value of the decimal m×10^-6. When that
// is f, the decimal reads back as f; and as it has at most 15 significant
// digits, no other decimal of at most 15 digits reads back as f (a float64
// tells such decimals apart), so it is the shortest that does, the one
// AppendFloat writes: its integer part, and its fraction without trailing
// zeros.
func appendMicros(b []byte, f float64) ([]byte, bool) {
	a := math.Abs(f)
	if !(a >= 1e-6 && a < 1e9) {
		return b, false
	}
	m := math.Round(a * 1e6)
	if m/1e6 != a {
		return b, false
	}
	u := uint64(m)
	if f < 0 {
		b = append(b, '-')
	}
	b = strconv.AppendUint(b, u/1e6, 10)
	if fr := u % 1e6; fr != 0 {
		var d [7]byte
		d[0] = '.'
		for i := 6; i >= 1; i-- {
			d[i] = byte('0' + fr%10)
			fr /= 10
		}
		n := 7
		for d[n-1] == '0' {
			n--
		}
		b = append(b, d[:n]...)
	}
	return b, true
}

func appendTime(b []byte, t time.Time) ([]byte, bool) {
	q, err := t.MarshalJSON()
	if err != nil {
		return b, false
	}
	return append(b, q...), true
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
		if r.Format < formatV1 || r.Format > formatVersion {
			return fmt.Errorf("ledger header: format %d; this stasis reads formats %d to %d (a newer stasis wrote it?)", r.Format, formatV1, formatVersion)
		}
		if err := CheckEpisode(r.Episode); err != nil {
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
	case kindBranch:
		if !isHash(r.From) {
			return fmt.Errorf(`branch record: "from" %q is not a record hash`, r.From)
		}
	case kindSettle:
		if len(r.Settled) == 0 {
			return errors.New(`settle record: "settled" names no entry`)
		}
		for _, s := range r.Settled {
			if err := s.check(); err != nil {
				return fmt.Errorf("settle record: %w", err)
			}
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
