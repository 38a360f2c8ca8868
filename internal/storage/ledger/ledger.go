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
//	{"kind":"branch","reason":"...","from":"<hash>","at":"...","parent":"...","hash":"..."}
//	    the logical ledger goes back to what it was right after the record
//	    with hash "from" (an earlier line): a restore of an older checkpoint;
//	    the entries of the history it leaves stay in the file
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
//
// # Storages
//
// The lines above are the same wherever they are kept (storage.go): in
// files (Files, what this comment describes) or in a PostgreSQL database
// (Postgres, postgres.go), where the gateways of several nodes share them
// and each append is fenced by the episode's attempt (Ledger.Fence)
// instead of by a lock.
package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"regexp"
	"sync"
	"time"
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

// CheckEpisode refuses an episode name that cannot name a ledger.
func CheckEpisode(episode string) error {
	if !episodeRE.MatchString(episode) {
		return fmt.Errorf("episode name %q: use 1 to 200 letters, digits, '.', '_' or '-', starting with a letter or digit (it names the file EPISODE.ledger)", episode)
	}
	return nil
}

// Path returns the file that holds episode's ledger in dir. It fails for an
// episode name that could leave dir.
func Path(dir, episode string) (string, error) {
	if err := CheckEpisode(episode); err != nil {
		return "", err
	}
	return filepath.Join(dir, episode+".ledger"), nil
}

// Ledger is one episode's open ledger. It is safe for concurrent use.
type Ledger struct {
	mu      sync.Mutex
	storage Storage
	where   string // names the ledger in messages
	episode string
	log     Log
	off     int64 // end of the last complete record
	fence   int   // the attempt appends are made for (Fence)
	st      *state
	// fps are the fingerprints of the first live entries' assistant
	// messages, worked out when a match needs them (fingerprints).
	fps    []string
	err    error // sticky: after a failed flush, or a fenced write, nothing more is written
	closed bool
}

// Open opens (creating it and dir when missing) the ledger of episode in dir,
// DIR/EPISODE.ledger, and takes an exclusive lock on it for as long as it
// is open. It is OpenIn(Files(dir), episode).
func Open(dir, episode string) (*Ledger, error) {
	return OpenIn(Files(dir), episode)
}

// OpenIn opens (creating it when missing) the ledger of episode in s for
// appending.
func OpenIn(s Storage, episode string) (*Ledger, error) {
	if err := CheckEpisode(episode); err != nil {
		return nil, err
	}
	log, data, err := s.OpenLog(episode)
	if err != nil {
		return nil, err
	}
	where := s.Where(episode)
	st, prob := load(data, episode, false)
	if prob != nil {
		log.Close()
		return nil, fmt.Errorf("ledger %s: %w: %s; nothing was changed: run `stasis ledger verify %s` for details, and restore it from a copy or discard the episode", where, ErrCorrupt, prob, episode)
	}
	return &Ledger{storage: s, where: where, episode: episode, log: log, off: st.off, st: st}, nil
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

// Path returns the ledger's file (for a ledger in a database, what names
// it there).
func (l *Ledger) Path() string { return l.where }

// Episode returns the episode whose ledger this is.
func (l *Ledger) Episode() string { return l.episode }

// Err is why the ledger writes nothing more (a write whose outcome is not
// known, or another writer took it: open it again), or nil.
func (l *Ledger) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

func (l *Ledger) usable() error {
	if l.closed {
		return fmt.Errorf("ledger %s: %w", l.where, ErrClosed)
	}
	if l.err != nil {
		return fmt.Errorf("ledger %s: an earlier write failed, so nothing more is written: %w; reopen it", l.where, l.err)
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
	var ends [4]int64 // where each record ends in buf (a write has at most 3)
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
		if i < len(ends) {
			ends[i] = int64(len(buf))
		}
	}
	if err := l.log.Append(l.off, buf, l.fence); err != nil {
		if errors.Is(err, ErrFenced) || errors.Is(err, ErrUnflushed) {
			// Another writer has the ledger, or after a failed flush
			// the page cache cannot be trusted to say what is on disk:
			// stop writing.
			l.err = err
		}
		return nil, err
	}
	start := l.off
	l.off += int64(len(buf))
	for i, r := range recs {
		if r.Kind == kindBranch {
			// A branch goes back to an earlier state: read it again.
			if err := l.reload(); err != nil {
				l.err = err
				return nil, err
			}
			continue
		}
		if err := l.st.apply(r); err != nil { // cannot happen: the records were built valid
			l.err = err
			return nil, fmt.Errorf("ledger %s: %w", l.where, err)
		}
		if i < len(ends) {
			l.st.ends[r.Hash] = l.st.markAt(start + ends[i])
		}
	}
	return recs, nil
}

// reload reads the ledger's state again from its storage. l.mu is held.
func (l *Ledger) reload() error {
	data, err := l.storage.ReadAll(l.episode)
	if err != nil {
		return fmt.Errorf("ledger %s: read it again: %w", l.where, err)
	}
	if int64(len(data)) < l.off {
		return fmt.Errorf("ledger %s: read it again: it holds %d bytes, fewer than the %d written", l.where, len(data), l.off)
	}
	st, prob := load(data[:l.off], l.episode, false)
	if prob != nil {
		return fmt.Errorf("ledger %s: read it again: %w: %s", l.where, ErrCorrupt, prob)
	}
	l.st, l.fps = st, nil
	return nil
}

// Tip is the ledger's last record: how many records it holds and the hash
// of the last. A checkpoint records it, so that a restore of that
// checkpoint can take the ledger back to it (Branch) however far it has
// moved on since.
type Tip struct {
	Records int    `json:"records"`
	Hash    string `json:"hash"`
}

// Tip returns the ledger's tip.
func (l *Ledger) Tip() Tip {
	l.mu.Lock()
	defer l.mu.Unlock()
	return Tip{Records: l.st.records, Hash: l.st.head}
}

// Has reports whether the ledger holds a record with hash h.
func (l *Ledger) Has(h string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.st.ends[h]
	return ok
}

// Branch takes the logical ledger back to what it was right after the
// record with hash from (a Tip's), whatever happened since: cuts, calls,
// other branches. It appends a branch record; nothing is rewritten, and the
// entries it leaves behind stay readable (Read lists them as dropped). The
// next entry continues from the history at from. It is how an older
// checkpoint is restored after the ledger has moved on past it.
func (l *Ledger) Branch(from, reason string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return err
	}
	if _, ok := l.st.ends[from]; !ok {
		return fmt.Errorf("ledger %s: cannot branch from record %.12s…: it holds no record with that hash", l.where, from)
	}
	if reason == "" {
		reason = "branch"
	}
	_, err := l.write(record{Kind: kindBranch, From: from, Reason: reason, At: time.Now().UTC()})
	return err
}

// Refresh reads the ledger again when its storage holds more than this
// ledger read: in a storage several writers share (a database the
// gateways of several nodes write), an episode that ran on another node
// since this one opened its ledger and has come back. Nothing is written;
// a ledger whose storage holds what it read is left as it is. A ledger
// that fails a write is still to be opened again (Err). A ledger whose
// log is its only writer (a file under this ledger's lock) has nothing
// to read again, and is not read: a restore refreshes every episode's
// ledger, and reading each whole file grew with the ledger. A storage
// that can tell a ledger's length cheaply (PostgreSQL) is read only when
// the length has changed.
func (l *Ledger) Refresh() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return fmt.Errorf("ledger %s: %w", l.where, ErrClosed)
	}
	if x, ok := l.log.(exclusive); ok && x.Exclusive() {
		return nil
	}
	if s, ok := l.storage.(sizer); ok {
		n, err := s.Size(l.episode)
		switch {
		case errors.Is(err, fs.ErrNotExist) && l.off == 0:
			return nil
		case err == nil && n == l.off:
			return nil // no one has appended since: nothing to read
		}
	}
	data, err := l.storage.ReadAll(l.episode)
	switch {
	case errors.Is(err, fs.ErrNotExist) && l.off == 0:
		return nil // nothing written yet, here or elsewhere
	case err != nil:
		return fmt.Errorf("ledger %s: read it again: %w", l.where, err)
	case int64(len(data)) == l.off:
		return nil
	}
	st, prob := load(data, l.episode, false)
	if prob != nil {
		return fmt.Errorf("ledger %s: read it again: %w: %s", l.where, ErrCorrupt, prob)
	}
	if st.off < l.off {
		return fmt.Errorf("ledger %s: read it again: it holds %d bytes, fewer than the %d read before", l.where, st.off, l.off)
	}
	l.st, l.off, l.fps = st, st.off, nil
	return nil
}

// Restart takes the logical ledger back to its start, with no entries
// and not broken (a branch to its header), whatever happened since: an
// episode started again from its task as its next attempt begins a
// history of its own. The entries it leaves stay readable (Read lists
// them as dropped), and a restore of a checkpoint of them branches back
// to them. A ledger already at its start is left as it is.
func (l *Ledger) Restart(reason string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return err
	}
	if len(l.st.entries) == 0 && !l.st.broken {
		return nil
	}
	if reason == "" {
		reason = "restart"
	}
	_, err := l.write(record{Kind: kindBranch, From: l.st.start, Reason: reason, At: time.Now().UTC()})
	return err
}

// EntriesAt returns the logical ledger as it was right after the record
// with hash at (a Tip's), each entry with its disposition then.
func (l *Ledger) EntriesAt(at string) ([]Entry, error) {
	l.mu.Lock()
	m, ok := l.st.ends[at]
	off := l.off
	l.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("ledger %s: no record with hash %.12s…", l.where, at)
	}
	end := m.end
	data, err := l.storage.ReadAll(l.episode)
	if err != nil {
		return nil, err
	}
	if int64(len(data)) < off {
		return nil, fmt.Errorf("ledger %s: it holds %d bytes, fewer than the %d written", l.where, len(data), off)
	}
	st, prob := load(data[:end], l.episode, false)
	if prob != nil {
		return nil, fmt.Errorf("ledger %s: %w: %s", l.where, ErrCorrupt, prob)
	}
	return st.entries, nil
}

// HistoryAt returns how many entries the logical ledger held right after
// the record with hash at (a Tip's) and the hash of the last of them (""
// when none), without reading the ledger's storage: what a restore needs
// to learn whether the ledger still holds a checkpoint's history (the
// entry at n is the same then and now), which it asks of every episode
// that made calls since the checkpoint. EntriesAt returns the entries
// themselves.
func (l *Ledger) HistoryAt(at string) (n int64, last string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m, ok := l.st.ends[at]
	if !ok {
		return 0, "", fmt.Errorf("ledger %s: no record with hash %.12s…", l.where, at)
	}
	return m.n, m.last, nil
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
		return Entry{}, nil, fmt.Errorf("ledger %s: call %s: %w at seq %d: answer it with the recorded response (Lookup) instead of appending again", l.where, e.CallID, ErrDuplicate, i+1)
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
		return fmt.Errorf("ledger %s: cannot cut to %d: the ledger has %d entries; use a position from 0 to %d", l.where, pos, n, n)
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
	return l.log.Close()
}

// Fence makes the ledger's writes those of the episode's attempt: from
// then on, writes of a lower attempt are refused everywhere the storage
// is shared (ErrFenced), and so are this Ledger's once a higher attempt
// has fenced it elsewhere. A restore fences the ledger with its new
// attempt before it cuts or branches it.
func (l *Ledger) Fence(attempt int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.usable(); err != nil {
		return err
	}
	if err := l.log.Fence(attempt); err != nil {
		l.err = err
		return err
	}
	l.fence = attempt
	return nil
}
