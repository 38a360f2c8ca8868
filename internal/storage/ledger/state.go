package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"
)

// state is what the records of a file add up to.
type state struct {
	episode      string
	format       int   // the header's
	records      int   // complete, valid lines
	off          int64 // bytes those lines take
	head         string
	start        string  // the header's hash: where Restart branches back to
	entries      []Entry // the logical ledger
	settled      []bool  // per live entry: a settle record named it
	index        map[string]int
	nextBoundary bool // the last control record was a cut with boundary and no entry followed
	broken       bool
	reason       string
	total        int64 // entry records in the file, cut ones included
	events       []Event
	// keepDropped: keep the entries cuts drop in dropped (Read wants
	// them; an open ledger does not).
	keepDropped bool
	dropped     []Entry
	// dropCounts counts the entries cuts dropped by disposition, and
	// droppedAs is each dropped entry's disposition then, by its hash (a
	// branch may bring it back).
	dropCounts map[Disposition]int64
	droppedAs  map[string]Disposition
	// ends is, by each record's hash, where the record ends in the bytes
	// and the logical ledger right after it: what a branch goes back to,
	// and what a restore compares with the ledger now (HistoryAt).
	ends map[string]mark
}

// mark is the ledger right after one record: where the record ends in the
// bytes (the offset after its newline), how many entries the logical
// ledger held then, and the last one's hash ("" when none).
type mark struct {
	end  int64
	n    int64
	last string
}

// markAt returns the mark of the state as it is, its last record ending
// at end.
func (s *state) markAt(end int64) mark {
	m := mark{end: end, n: int64(len(s.entries))}
	if m.n > 0 {
		m.last = s.entries[m.n-1].Hash
	}
	return m
}

func newState(episode string) *state {
	return &state{episode: episode, index: map[string]int{}, dropCounts: map[Disposition]int64{},
		droppedAs: map[string]Disposition{}, ends: map[string]mark{}}
}

// Event is a control record of the file: a cut or a broken mark.
type Event struct {
	Line     int    `json:"line"`
	Kind     string `json:"kind"` // "cut", "broken" or "branch"
	To       int64  `json:"to"`   // cut, branch: the new length; broken: the length then
	From     int64  `json:"from"` // the logical length before
	Reason   string `json:"reason"`
	Boundary bool   `json:"boundary,omitempty"` // cut by a relaunch match: the next entry is a boundary
	// FromRecord, of a branch, is the hash of the record whose history
	// the ledger went back to.
	FromRecord string    `json:"from_record,omitempty"`
	At         time.Time `json:"at"`
}

// Problem is the first bad record of a file.
type Problem struct {
	Line int    `json:"line"`           // 1-based line number
	Seq  int64  `json:"seq,omitempty"`  // the entry's seq, when the line is an entry that parsed
	Kind string `json:"kind,omitempty"` // the record's kind, when it parsed
	What string `json:"what"`           // what is wrong
}

func (p *Problem) String() string {
	s := "line " + strconv.Itoa(p.Line)
	if p.Seq > 0 {
		s += " (seq " + strconv.FormatInt(p.Seq, 10) + ")"
	} else if p.Kind != "" {
		s += " (" + p.Kind + ")"
	}
	return s + ": " + p.What
}

// apply adds one decoded record (hash already checked) to the state.
func (s *state) apply(r record) error {
	if r.Parent != s.head {
		if s.head == "" {
			return fmt.Errorf("parent %.12s… but this is the first record (its parent must be empty): lines were removed before it", r.Parent)
		}
		return fmt.Errorf("parent %.12s… is not the previous record's hash %.12s…: a record was removed, inserted or reordered", r.Parent, s.head)
	}
	if (s.records == 0) != (r.Kind == kindHeader) {
		if s.records == 0 {
			return fmt.Errorf("the first record is a %s record; a ledger starts with its header (kind %q)", r.Kind, kindHeader)
		}
		return errors.New("a second ledger header: two ledgers were concatenated")
	}
	n := int64(len(s.entries))
	switch r.Kind {
	case kindHeader:
		if r.Episode != s.episode {
			return fmt.Errorf("this is the ledger of episode %q, not %q: the file was renamed or copied", r.Episode, s.episode)
		}
		s.format = r.Format
		s.start = r.Hash
	case kindEntry:
		if r.Seq != n+1 {
			return fmt.Errorf("seq %d, but the logical ledger has %d entries here, so it must be %d", r.Seq, n, n+1)
		}
		if i, ok := s.index[r.CallID]; ok {
			return fmt.Errorf("call %s is already live at seq %d: a call is recorded once", r.CallID, i+1)
		}
		s.index[r.CallID] = len(s.entries)
		e := r.entry()
		e.Disposition = s.unsettled()
		s.entries = append(s.entries, e)
		s.settled = append(s.settled, false)
		s.nextBoundary = false
		s.total++
	case kindCut:
		to := *r.To
		if to > n {
			return fmt.Errorf("cut to %d, but the logical ledger has only %d entries here", to, n)
		}
		s.drop(to)
		s.nextBoundary = r.Boundary
		s.events = append(s.events, Event{Line: s.records + 1, Kind: kindCut, To: to, From: n, Reason: r.Reason, Boundary: r.Boundary, At: r.At})
	case kindBroken:
		s.broken = true
		s.reason = r.Reason
		s.events = append(s.events, Event{Line: s.records + 1, Kind: kindBroken, To: n, From: n, Reason: r.Reason, At: r.At})
	case kindSettle:
		// A settle record repeating a disposition is harmless; one that
		// changes a disposition, or names an entry that is not live, is
		// not something Settle writes.
		fresh, err := s.checkSettle(r.Settled)
		if err != nil {
			return fmt.Errorf("settle record: %w", err)
		}
		for _, x := range fresh {
			s.entries[x.Seq-1].Disposition = x.Disposition
			s.settled[x.Seq-1] = true
		}
	case kindBranch:
		return errors.New("a branch record needs the records before it (load applies it)")
	}
	s.head = r.Hash
	s.records++
	return nil
}

// drop cuts the live entries to their first to, counting those it drops.
func (s *state) drop(to int64) {
	for i, e := range s.entries[to:] {
		delete(s.index, e.CallID)
		if !s.settled[to+int64(i)] {
			e.Disposition = Undelivered
		}
		s.dropCounts[e.Disposition]++
		s.droppedAs[e.Hash] = e.Disposition
		if s.keepDropped {
			s.dropped = append(s.dropped, e)
		}
	}
	s.entries = s.entries[:to:to] // later appends must not overwrite entries a caller holds
	s.settled = s.settled[:to]
}

// applyBranch applies a branch record r: the logical ledger becomes past's,
// the state as it was right after the record r.From (load kept it as it
// walked past there). Entries live now and not in past's history are
// dropped, as a cut drops them; entries of past's history that a cut or
// a branch had dropped are live again; every entry has the disposition it
// had at r.From.
func (s *state) applyBranch(r record, past pastState) error {
	if r.Parent != s.head {
		return fmt.Errorf("parent %.12s… is not the previous record's hash %.12s…: a record was removed, inserted or reordered", r.Parent, s.head)
	}
	n := int64(len(s.entries))
	common := int64(0)
	for common < n && common < int64(len(past.entries)) && s.entries[common].Hash == past.entries[common].Hash {
		common++
	}
	s.drop(common)
	// The entries both hold are as they were at r.From: settled or not.
	s.entries = slices.Clone(s.entries)
	for i := range common {
		s.entries[i].Disposition = past.entries[i].Disposition
		s.settled[i] = past.settled[i]
	}
	for i, e := range past.entries[common:] {
		if d, ok := s.droppedAs[e.Hash]; ok {
			s.dropCounts[d]--
			delete(s.droppedAs, e.Hash)
			if s.keepDropped {
				s.dropped = slices.DeleteFunc(s.dropped, func(x Entry) bool { return x.Hash == e.Hash })
			}
		}
		s.entries = append(s.entries, e)
		s.settled = append(s.settled, past.settled[common+int64(i)])
		s.index[e.CallID] = int(common) + i
	}
	s.nextBoundary = past.nextBoundary
	s.broken, s.reason = past.broken, past.reason
	s.events = append(s.events, Event{Line: s.records + 1, Kind: kindBranch, To: int64(len(s.entries)), From: n, Reason: r.Reason, FromRecord: r.From, At: r.At})
	s.head = r.Hash
	s.records++
	return nil
}

// load walks a file's bytes (keepDropped: keep the entries cuts dropped in
// st.dropped). It stops at the first bad line and returns it
// as a Problem; a last line without its newline is not a problem (a torn
// append that was never acknowledged): it is left out, and st.off ends
// before it.
func load(data []byte, episode string, keepDropped bool) (*state, *Problem) {
	var targets map[string]int
	if scanBranches {
		targets = branchTargets(data)
	}
	return loadWith(data, episode, keepDropped, targets)
}

// scanBranches is false only in tests and benchmarks that measure a load
// going back to each branch's record by loading the bytes up to there.
var scanBranches = true

// loadWith is load, given what branchTargets(data) returns. The state right
// after each record in targets is kept as the walk passes it, until its
// last branch is applied: a branch record needs it, and loading the bytes
// up to there again for each branch would cost, over branches that each
// go back past the one before, time that doubles with every branch. A
// branch to a record not in targets loads the bytes up to there.
func loadWith(data []byte, episode string, keepDropped bool, targets map[string]int) (*state, *Problem) {
	loads.Add(1)
	st := newState(episode)
	st.keepDropped = keepDropped
	pasts := map[string]pastState{}
	rest := data
	for len(rest) > 0 {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			break // torn last line
		}
		line := rest[:i]
		p := &Problem{Line: st.records + 1}
		r, err := decodeRecord(line)
		p.Kind, p.Seq = r.Kind, r.Seq
		if err != nil {
			p.What = err.Error()
			return st, p
		}
		if r.Kind == kindBranch {
			at, ok := st.ends[r.From]
			if !ok {
				p.What = fmt.Sprintf("branch from record %.12s…, which is not an earlier record of this ledger", r.From)
				return st, p
			}
			back, ok := pasts[r.From]
			if !ok {
				// The scan missed it (a branch record written
				// otherwise than this package writes it): load the
				// bytes up to there.
				past, prob := load(data[:at.end], episode, false)
				if prob != nil { // cannot happen: those bytes loaded once already
					return st, prob
				}
				back = past.past()
			}
			if targets[r.From] > 0 {
				if targets[r.From]--; targets[r.From] == 0 {
					delete(pasts, r.From)
				}
			}
			err = st.applyBranch(r, back)
		} else {
			err = st.apply(r)
		}
		if err != nil {
			p.What = err.Error()
			return st, p
		}
		st.off += int64(i + 1)
		st.ends[r.Hash] = st.markAt(st.off)
		if targets[r.Hash] > 0 {
			pasts[r.Hash] = st.past()
		}
		rest = rest[i+1:]
	}
	return st, nil
}

// loads counts the walks of a ledger's bytes (load, loadWith), for the
// tests.
var loads atomic.Int64

// branchTargets returns, for each record that a branch record in data
// goes back to (its From), how many branch records do. A line is decoded
// only if it holds the word "branch", so the scan costs little; a branch
// record it misses (its kind written with escapes) is still loaded
// right, only more slowly.
func branchTargets(data []byte) map[string]int {
	var targets map[string]int
	word := []byte(`"` + kindBranch + `"`)
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		if !bytes.Contains(line, word) {
			continue
		}
		if r, err := decodeRecord(line); err == nil && r.Kind == kindBranch {
			if targets == nil {
				targets = map[string]int{}
			}
			targets[r.From]++
		}
	}
	return targets
}

// pastState is what a branch takes from the state it goes back to.
type pastState struct {
	entries      []Entry
	settled      []bool
	nextBoundary bool
	broken       bool
	reason       string
}

// past copies what a branch back to s as it is now needs: a settle
// changes entries in place, so the entries are copied.
func (s *state) past() pastState {
	return pastState{entries: slices.Clone(s.entries), settled: slices.Clone(s.settled),
		nextBoundary: s.nextBoundary, broken: s.broken, reason: s.reason}
}

// Report is what Verify found.
type Report struct {
	Path    string `json:"path"`
	Episode string `json:"episode"`
	Format  int    `json:"format"` // the header's; 0 when the file has none
	OK      bool   `json:"ok"`
	// Bad is the first bad record; nil when OK.
	Bad *Problem `json:"bad,omitempty"`
	// Counts over the good records (up to Bad, when there is one).
	Records      int    `json:"records"` // lines, the header included
	Entries      int64  `json:"entries"` // entry records, cut ones included
	Live         int64  `json:"live"`    // the logical length
	Cuts         int    `json:"cuts"`
	Broken       bool   `json:"broken"`
	BrokenReason string `json:"broken_reason,omitempty"`
	Head         string `json:"head"` // the last good record's hash
	// Entries by disposition, cut ones included (they add up to Entries):
	// live entries are Delivered, Abandoned or Pending; a cut entry keeps
	// the disposition it was settled with, or is Undelivered.
	Delivered   int64 `json:"delivered"`
	Abandoned   int64 `json:"abandoned"`
	Pending     int64 `json:"pending"`
	Undelivered int64 `json:"undelivered"`
	// TornBytes is the size of an unfinished last line (a crash in the
	// middle of an append); it is ignored, and the next append removes it.
	TornBytes int64 `json:"torn_bytes,omitempty"`
}

// Verify walks the whole ledger file of episode in dir — every hash, every
// parent link, every sequence number — without locking it. A damaged file is
// not an error: the Report says which record is bad. The error is for a
// file that cannot be read (fs.ErrNotExist when there is none).
func Verify(dir, episode string) (Report, error) {
	return VerifyIn(Files(dir), episode)
}

// VerifyIn is Verify of the ledger of episode in s.
func VerifyIn(s Storage, episode string) (Report, error) {
	if err := CheckEpisode(episode); err != nil {
		return Report{}, err
	}
	path := s.Where(episode)
	data, err := s.ReadAll(episode)
	if err != nil {
		return Report{}, err
	}
	st, prob := load(data, episode, false)
	rep := Report{
		Path: path, Episode: episode, Format: st.format, OK: prob == nil, Bad: prob,
		Records: st.records, Entries: st.total, Live: int64(len(st.entries)),
		Broken: st.broken, BrokenReason: st.reason, Head: st.head,
	}
	count := func(d Disposition, n int64) {
		switch d {
		case Delivered:
			rep.Delivered += n
		case Abandoned:
			rep.Abandoned += n
		case Pending:
			rep.Pending += n
		case Undelivered:
			rep.Undelivered += n
		}
	}
	for d, n := range st.dropCounts {
		count(d, n)
	}
	for _, e := range st.entries {
		count(e.Disposition, 1)
	}
	for _, e := range st.events {
		if e.Kind == kindCut {
			rep.Cuts++
		}
	}
	if prob == nil {
		rep.TornBytes = int64(len(data)) - st.off
	}
	return rep, nil
}

// History is a ledger file as Read sees it.
type History struct {
	Path    string  `json:"path"`
	Episode string  `json:"episode"`
	Format  int     `json:"format"`  // the header's
	Entries []Entry `json:"entries"` // the logical ledger, each with its disposition
	// Dropped are the entries cuts dropped, in file order: Undelivered,
	// or the disposition they were settled with before the cut.
	Dropped   []Entry `json:"dropped"`
	Events    []Event `json:"events"` // cuts and broken marks, in file order
	Total     int64   `json:"total"`  // entry records in the file, cut ones included
	Broken    bool    `json:"broken"`
	Reason    string  `json:"reason,omitempty"`
	TornBytes int64   `json:"torn_bytes,omitempty"`
}

// Read loads the ledger of episode in dir without locking it (a gateway may
// be appending). A damaged file fails with ErrCorrupt.
func Read(dir, episode string) (History, error) {
	return ReadIn(Files(dir), episode)
}

// ReadIn is Read of the ledger of episode in s.
func ReadIn(s Storage, episode string) (History, error) {
	if err := CheckEpisode(episode); err != nil {
		return History{}, err
	}
	path := s.Where(episode)
	data, err := s.ReadAll(episode)
	if err != nil {
		return History{}, err
	}
	st, prob := load(data, episode, true)
	if prob != nil {
		return History{}, fmt.Errorf("ledger %s: %w: %s; run `stasis ledger verify %s` for details", path, ErrCorrupt, prob, episode)
	}
	h := History{
		Path: path, Episode: episode, Format: st.format, Entries: st.entries, Dropped: st.dropped,
		Events: st.events, Total: st.total, Broken: st.broken, Reason: st.reason, TornBytes: int64(len(data)) - st.off,
	}
	if h.Entries == nil {
		h.Entries = []Entry{}
	}
	if h.Dropped == nil {
		h.Dropped = []Entry{}
	}
	if h.Events == nil {
		h.Events = []Event{}
	}
	return h, nil
}
