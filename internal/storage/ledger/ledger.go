// Package ledger is the append-only, per-episode record of every model call
// the gateway forwards: the request as the model server got it, the whole
// response, usage, and the token ids and logprobs when the model server gave
// them. It serves one invariant: after any restore, an episode's ledger holds
// exactly the model responses its harness has acted on, in order, each once.
//
// # File format
//
// One file per episode, DIR/EPISODE.ledger, in JSON lines: one JSON object
// per line, each ending in "\n". The file is only ever appended to. Every
// line has a "kind", a "parent" (the hash of the line before it, "" for the
// first line) and, as its last field, a "hash": the SHA-256, in lowercase hex,
// of the line's bytes as written with an empty hash value — that is, of the
// line with its 64 hex digits taken out. Changing any byte of a line breaks
// its hash; removing, reordering or inserting a line breaks the parent chain.
// The kinds:
//
//	{"kind":"ledger","format":2,"episode":"ep1","at":"...","parent":"","hash":"..."}
//	    the first line: which episode the file belongs to, and the format
//	    (see below)
//	{"kind":"entry","seq":1,"call_id":"ep1/1","attempt":1,"request":{...},
//	 "response":{...},"usage":{...},"tokens":{...},"started":"...",
//	 "finished":"...","boundary":true,"parent":"...","hash":"..."}
//	    one model call; seq is its position in the logical ledger
//	{"kind":"cut","to":3,"reason":"...","boundary":true,"at":"...","parent":"...","hash":"..."}
//	    the logical ledger becomes its first "to" entries; with boundary, the
//	    next entry is the first after a relaunch match (training masks it)
//	{"kind":"broken","reason":"...","at":"...","parent":"...","hash":"..."}
//	    the history can no longer be trusted (a relaunch did not match)
//	{"kind":"settle","settled":[{"seq":3,"call_id":"ep1/3","disposition":"delivered"},
//	 {"seq":4,"call_id":"ep1/4","disposition":"abandoned"}],"at":"...","parent":"...","hash":"..."}
//	    the dispositions of live entries, each named by seq and call id:
//	    "delivered" (the harness got the whole response) or "abandoned"
//	    (the client had gone and never saw it); at least one; an entry's
//	    disposition, once settled, does not change
//
// The logical ledger is computed from the file: entries in order, a cut
// drops the entries after its position, and the next entry continues the
// numbering from there (its seq is the cut position + 1). Unknown fields are
// ignored when reading, but they are covered by the hash.
//
// Each entry has a disposition (Entry.Disposition), computed from the file,
// not written in the entry's record: that of the settle record naming it, or,
// when none does, Pending. An entry a cut drops without having been settled
// is Undelivered. Format 2 is the format this package writes; format 1
// ledgers, written before dispositions were recorded, still read, verify
// and take appends (their header stays as it is): there an entry no settle
// record names reads as Delivered, which is what every entry meant then.
// A header with another format is refused.
//
// # Durability and crashes
//
// Append writes the line and flushes it to disk before it returns, so an
// entry is on disk before the gateway lets its response reach the harness.
// Appends to many ledgers at once share their flushes (group commit; see
// groupsync.go). A crash in the middle of an append leaves a last line
// without its newline: it was never acknowledged, so readers ignore it and
// the next append truncates it away. A damaged line anywhere else — one that does not parse, whose hash
// does not match, or whose parent is not the line before — makes Open fail;
// Verify names the line and what is wrong with it.
//
// One process at a time writes a ledger: Open takes an exclusive flock on the
// file, and a second Open, in this process or another, fails with ErrLocked.
// Read and Verify take no lock and may run while a gateway appends.
package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/storage/atomicfile"
)

// Entry is one model call in the ledger.
type Entry struct {
	Seq      int64           `json:"seq"`      // 1-based position in the logical ledger
	CallID   string          `json:"call_id"`  // stable across re-issues: "<episode>/<n>"
	Attempt  int             `json:"attempt"`  // the episode's attempt that made the call
	Parent   string          `json:"parent"`   // hash of the previous record in the file
	Request  json.RawMessage `json:"request"`  // the request body as the model server got it
	Response json.RawMessage `json:"response"` // the whole response (a streamed one assembled)
	Usage    json.RawMessage `json:"usage,omitempty"`
	Tokens   *Tokens         `json:"tokens,omitempty"` // token ids and logprobs when the model server gave them
	Started  time.Time       `json:"started"`
	Finished time.Time       `json:"finished"`
	Boundary bool            `json:"boundary,omitempty"` // first entry after a relaunch match (training masks it)
	Hash     string          `json:"hash"`               // over every other field, chained through Parent
	// Disposition is what became of the response, worked out from the
	// file's settle records (and cuts); it is not part of the entry's
	// record, nor of its hash.
	Disposition Disposition `json:"disposition,omitempty"`
}

// Errors callers can test for with errors.Is.
var (
	// ErrBroken: a relaunched harness's conversation did not match the
	// ledger; the history is marked broken.
	ErrBroken = errors.New("episode history is broken")
	// ErrCorrupt: a record in the middle of the file is damaged.
	ErrCorrupt = errors.New("ledger file is damaged")
	// ErrLocked: another Ledger, in this process or another, has the file open.
	ErrLocked = errors.New("ledger is open elsewhere")
	// ErrDuplicate: Append of a call id that is already in the logical ledger.
	ErrDuplicate = errors.New("call is already in the ledger")
	// ErrClosed: the Ledger was closed.
	ErrClosed = errors.New("ledger is closed")
)

var episodeRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$`)

func checkEpisode(episode string) error {
	if !episodeRE.MatchString(episode) {
		return fmt.Errorf("episode name %q: use 1 to 200 letters, digits, '.', '_' or '-', starting with a letter or digit (it names the file EPISODE.ledger)", episode)
	}
	return nil
}

// Path returns the file that holds episode's ledger in dir. It fails for an
// episode name that could leave dir.
func Path(dir, episode string) (string, error) {
	if err := checkEpisode(episode); err != nil {
		return "", err
	}
	return filepath.Join(dir, episode+".ledger"), nil
}

// Ledger is one episode's open ledger. It is safe for concurrent use.
type Ledger struct {
	mu      sync.Mutex
	path    string
	episode string
	f       *os.File
	off     int64 // end of the last complete record
	torn    bool  // bytes after off (a torn or failed write) must go before the next write
	st      *state
	// fps are the fingerprints of the first live entries' assistant
	// messages, worked out when a match needs them (fingerprints).
	fps    []string
	err    error // sticky: after a failed flush nothing more is written
	closed bool
	group  *syncGroup // the group commit of the file system that holds f
}

// Open opens (creating it and dir when missing) the ledger of episode in dir,
// DIR/EPISODE.ledger, and takes an exclusive lock on it for as long as it
// is open.
func Open(dir, episode string) (*Ledger, error) {
	path, err := Path(dir, episode)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("ledger directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	created := err == nil
	if errors.Is(err, os.ErrExist) {
		f, err = os.OpenFile(path, os.O_RDWR, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("open ledger: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("ledger %s: %w: another process (or another Open in this one) holds its lock; only one gateway may write an episode's ledger, so close it there first", path, ErrLocked)
		}
		return nil, fmt.Errorf("lock ledger %s: %w", path, err)
	}
	if created {
		if err := atomicfile.SyncDir(dir); err != nil {
			f.Close()
			return nil, fmt.Errorf("open ledger: %w", err)
		}
	}
	data, err := io.ReadAll(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("read ledger %s: %w", path, err)
	}
	st, prob := load(data, episode, false)
	if prob != nil {
		f.Close()
		return nil, fmt.Errorf("ledger %s: %w: %s; nothing was changed: run `stasis ledger verify %s --dir %s` for details, and restore the file from a copy or discard the episode", path, ErrCorrupt, prob, episode, dir)
	}
	group, err := groupFor(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("open ledger: %w", err)
	}
	return &Ledger{path: path, episode: episode, f: f, off: st.off, torn: st.off < int64(len(data)), st: st, group: group}, nil
}

// fingerprints returns the fingerprint of each live entry's assistant
// message, working out those not known yet. Only a relaunch match needs
// them, so appends and opens do not spend time on them. l.mu is held.
func (l *Ledger) fingerprints() []string {
	for i := len(l.fps); i < len(l.st.entries); i++ {
		l.fps = append(l.fps, responseFingerprint(l.st.entries[i].Response))
	}
	return l.fps
}

// Path returns the ledger's file.
func (l *Ledger) Path() string { return l.path }

// Episode returns the episode whose ledger this is.
func (l *Ledger) Episode() string { return l.episode }

func (l *Ledger) usable() error {
	if l.closed {
		return fmt.Errorf("ledger %s: %w", l.path, ErrClosed)
	}
	if l.err != nil {
		return fmt.Errorf("ledger %s: an earlier write failed, so nothing more is written: %w; reopen it", l.path, l.err)
	}
	return nil
}

// write appends recs (a header first when the file has none), chaining their
// parents from the current head, and flushes them to disk. It returns the
// records with parent and hash filled in; on success the caller applies
// them to l.st.
func (l *Ledger) write(recs ...record) ([]record, error) {
	if l.st.head == "" && l.st.records == 0 {
		recs = append([]record{{Kind: kindHeader, Format: formatVersion, Episode: l.episode, At: time.Now().UTC()}}, recs...)
	}
	bp := linePool.Get().(*[]byte)
	buf := (*bp)[:0]
	defer func() {
		if cap(buf) <= maxPooledLine {
			*bp = buf[:0]
			linePool.Put(bp)
		}
	}()
	parent := l.st.head
	for i := range recs {
		recs[i].Parent = parent
		var h string
		var err error
		if buf, h, err = appendRecordLine(buf, &recs[i], recs[i].canon); err != nil {
			return nil, err
		}
		recs[i].Hash = h
		parent = h
		buf = append(buf, '\n')
	}
	if l.torn {
		if err := l.f.Truncate(l.off); err != nil {
			return nil, fmt.Errorf("ledger %s: cut away the unfinished last line: %w", l.path, err)
		}
		l.torn = false
	}
	if _, err := l.f.WriteAt(buf, l.off); err != nil {
		l.torn = true
		return nil, fmt.Errorf("ledger %s: write: %w", l.path, err)
	}
	if err := l.group.sync(l.f); err != nil {
		// After a failed flush the page cache cannot be trusted to say
		// what is on disk: stop writing.
		l.err = err
		l.torn = true
		return nil, fmt.Errorf("ledger %s: %w", l.path, err)
	}
	l.off += int64(len(buf))
	for _, r := range recs {
		if err := l.st.apply(r); err != nil { // cannot happen: the records were built valid
			l.err = err
			return nil, fmt.Errorf("ledger %s: %w", l.path, err)
		}
	}
	return recs, nil
}

// linePool holds the buffers records are encoded into before their write.
// Buffers grown past maxPooledLine (a huge response) are left to the
// garbage collector.
var linePool = sync.Pool{New: func() any { b := make([]byte, 0, 16<<10); return &b }}

const maxPooledLine = 1 << 20

// canonJSON returns m as the file will hold it (compact), or an error for
// bytes that are not JSON.
func canonJSON(what string, m json.RawMessage) (json.RawMessage, error) {
	if len(m) == 0 {
		return nil, nil
	}
	if b, ok := appendCanon(make([]byte, 0, len(m)), m); ok {
		return b, nil
	}
	b, err := json.Marshal(m) // validates and compacts; says what is wrong
	if err != nil {
		if u := errors.Unwrap(err); u != nil {
			err = u // the syntax error, without encoding/json's wrapper
		}
		return nil, fmt.Errorf("%s is not valid JSON: %w", what, err)
	}
	return b, nil
}

// Append adds e as the next entry of the logical ledger and returns it with
// Seq, Parent, Hash and Disposition (Pending; Delivered in a format-1
// ledger) filled in; e.Disposition is ignored; the record is on disk (flushed) when Append
// returns. Tokens and Usage, when not given, are read from the response in
// one pass (see ExtractTokens).
// The first entry after a relaunch match is marked Boundary. A call id
// that is already in the logical ledger is refused with ErrDuplicate.
func (l *Ledger) Append(e Entry) (Entry, error) {
	e, _, err := l.SettleAndAppend(nil, e)
	return e, err
}

// SettleAndAppend is Settle and Append in one write and one flush: the
// relay's settlements of earlier calls ride on the next call's entry, so
// recording them costs no flush of its own. Settlements that do not hold
// (Settle would refuse them: an entry a cut took away, a disposition that
// contradicts the one recorded) are left out whole, the entry is appended
// all the same, and settleErr says why; err is the append's.
func (l *Ledger) SettleAndAppend(s []Settlement, e Entry) (_ Entry, settleErr, err error) {
	e, err = prepareEntry(e)
	if err != nil {
		return Entry{}, nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return Entry{}, nil, err
	}
	if i, ok := l.st.index[e.CallID]; ok {
		return Entry{}, nil, fmt.Errorf("ledger %s: call %s: %w at seq %d: answer it with the recorded response (Lookup) instead of appending again", l.path, e.CallID, ErrDuplicate, i+1)
	}
	var recs []record
	if len(s) > 0 {
		recs, settleErr = l.settleRecords(s)
	}
	e.Seq = int64(len(l.st.entries)) + 1
	e.Boundary = e.Boundary || l.st.nextBoundary
	rec := entryRecord(e)
	rec.canon = true
	if _, err := l.write(append(recs, rec)...); err != nil {
		return Entry{}, settleErr, err
	}
	return l.st.entries[len(l.st.entries)-1], settleErr, nil
}

// prepareEntry checks e and makes its JSON canonical, with its usage and
// tokens read from the response when not given.
func prepareEntry(e Entry) (Entry, error) {
	if e.CallID == "" {
		return Entry{}, errors.New("ledger append: empty call id: every entry needs the relay's call id (\"<episode>/<n>\")")
	}
	var err error
	if len(e.Response) == 0 {
		return Entry{}, fmt.Errorf("ledger append %s: no response: append only calls whose whole response is in hand", e.CallID)
	}
	if e.Response, err = canonJSON("response of "+e.CallID, e.Response); err != nil {
		return Entry{}, fmt.Errorf("ledger append: %w", err)
	}
	if e.Request, err = canonJSON("request of "+e.CallID, e.Request); err != nil {
		return Entry{}, fmt.Errorf("ledger append: %w", err)
	}
	// One pass over the (now canonical, so valid) response finds usage and
	// tokens.
	if e.Tokens == nil || len(e.Usage) == 0 {
		scan := scanTokens(e.Response)
		usage, tokens := scan.usage, scan.tokens
		if !scan.tokensOK {
			usage, tokens = extractJSON(e.Response)
		}
		if e.Tokens == nil {
			e.Tokens = tokens
		}
		if len(e.Usage) == 0 {
			e.Usage = usage
		}
	}
	if e.Usage, err = canonJSON("usage of "+e.CallID, e.Usage); err != nil {
		return Entry{}, fmt.Errorf("ledger append: %w", err)
	}
	return e, nil
}

// Lookup returns the live entry (in the logical ledger, not cut away) for a
// call id, with its disposition.
func (l *Ledger) Lookup(callID string) (Entry, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, ok := l.st.index[callID]
	if !ok {
		return Entry{}, false
	}
	return l.st.entries[i], true
}

// At returns the live entry at position seq (1-based), with its
// disposition.
func (l *Ledger) At(seq int64) (Entry, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if seq < 1 || seq > int64(len(l.st.entries)) {
		return Entry{}, false
	}
	return l.st.entries[seq-1], true
}

// Len returns the length of the logical ledger.
func (l *Ledger) Len() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return int64(len(l.st.entries))
}

// Entries returns the logical ledger, in order, each entry with its
// disposition. The raw JSON fields share
// memory with the ledger: do not modify them.
func (l *Ledger) Entries() []Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Entry(nil), l.st.entries...)
}

// Broken reports whether the episode's history has been marked broken, and
// why. A broken history stays broken: appends go on, but training must not
// trust it.
func (l *Ledger) Broken() (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.st.broken, l.st.reason
}

// Cut makes the logical ledger its first pos entries (a restore cuts to the
// relay's delivered count). It appends a cut record; nothing is rewritten.
// The next entry gets seq pos+1.
func (l *Ledger) Cut(pos int64, reason string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cut(pos, reason, false)
}

func (l *Ledger) cut(pos int64, reason string, boundary bool) error {
	if err := l.usable(); err != nil {
		return err
	}
	if n := int64(len(l.st.entries)); pos < 0 || pos > n {
		return fmt.Errorf("ledger %s: cannot cut to %d: the ledger has %d entries; use a position from 0 to %d", l.path, pos, n, n)
	}
	if reason == "" {
		reason = "cut"
	}
	if _, err := l.write(record{Kind: kindCut, To: &pos, Reason: reason, Boundary: boundary, At: time.Now().UTC()}); err != nil {
		return err
	}
	if int64(len(l.fps)) > pos {
		l.fps = l.fps[:pos]
	}
	return nil
}

func (l *Ledger) markBroken(reason string) error {
	if err := l.usable(); err != nil {
		return err
	}
	_, err := l.write(record{Kind: kindBroken, Reason: reason, At: time.Now().UTC()})
	return err
}

// Close releases the lock and closes the file. Closing twice is harmless.
func (l *Ledger) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	_ = unix.Flock(int(l.f.Fd()), unix.LOCK_UN)
	return l.f.Close()
}
