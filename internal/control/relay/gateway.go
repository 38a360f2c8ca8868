package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"stasis/errdefs"
	"stasis/internal/control/openapi"
	"stasis/internal/storage/ledger"
)

// EpisodeState is an episode as the gateway knows it:
// STATE/episodes/EPISODE.json.
type EpisodeState struct {
	Episode string    `json:"episode"`
	Token   string    `json:"token"`
	Attempt int       `json:"attempt"`
	Created time.Time `json:"created"`
	// NeedMatch: the episode was relaunched; its next call is matched
	// against the ledger (Ledger.Match) before it is recorded.
	NeedMatch bool `json:"need_match,omitempty"`
	// Sandbox is the sandbox the episode runs in now (Bind): on a
	// sandbox's own socket (SandboxHandler) only its episode's token is
	// valid.
	Sandbox string `json:"sandbox,omitempty"`
	// Revoked: the episode was retired (Revoke); its token is refused
	// until a restore brings the episode back.
	Revoked bool `json:"revoked,omitempty"`
}

// Credentials returns the relay's token file contents for this episode.
func (e EpisodeState) Credentials(nextCall int64) Credentials {
	return Credentials{Episode: e.Episode, Token: e.Token, Attempt: e.Attempt, NextCall: nextCall}
}

// GatewayConfig configures a Gateway.
type GatewayConfig struct {
	Upstream string // the model server
	State    string // directory: episodes/ and ledgers/
	// ModelKey is sent to the model server as a bearer token, if set.
	ModelKey string
	MaxBody  int64
	Logger   *slog.Logger
	// Clock stamps episodes and ledger entries (nil: the system's).
	Clock Clock
	// Ledgers keeps the episodes' ledgers (nil: files in State/ledgers).
	Ledgers ledger.Storage
	// Registry keeps the episodes' registrations (nil: files in
	// State/episodes).
	Registry Registry
}

// Gateway is the host end: it authenticates episodes by bearer token,
// refuses stale attempts, answers a call id already recorded from the
// ledger, and records every new response in the episode's ledger before it
// answers.
type Gateway struct {
	up    *Upstream
	cfg   GatewayConfig
	clock Clock
	log   *slog.Logger
	reg   *prometheus.Registry
	m     gatewayMetrics

	mu   sync.Mutex
	desk *desk // the episodes and the calls being answered, which decide
	// answered is closed (and replaced) when a call's claim ends: a
	// duplicate waiting for it asks the desk again.
	answered chan struct{}
	ledgers  map[string]*ledger.Ledger
	opening  map[string]chan struct{} // episode whose ledger is being opened
	epLocks  map[string]*sync.Mutex
}

type gatewayMetrics struct {
	calls                            *prometheus.CounterVec
	ok                               prometheus.Counter // calls{code="200"}
	dedupe, stale, unauthorized, bad prometheus.Counter
	upstream, added                  prometheus.Histogram
}

var episodeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidName reports whether id may name an episode: letters, digits, '.',
// '_' and '-', starting with a letter or digit, at most 128.
func ValidName(id string) bool { return episodeName.MatchString(id) }

// OpenGateway opens the gateway over its state directory.
func OpenGateway(cfg GatewayConfig) (*Gateway, error) {
	up, err := ParseUpstream(cfg.Upstream)
	if err != nil {
		return nil, err
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.Ledgers == nil {
		cfg.Ledgers = ledger.Files(filepath.Join(cfg.State, "ledgers"))
	}
	if cfg.Registry == nil {
		cfg.Registry = RegistryFiles(filepath.Join(cfg.State, "episodes"))
	}
	for _, d := range []string{"episodes", "ledgers"} {
		if err := os.MkdirAll(filepath.Join(cfg.State, d), 0o700); err != nil {
			return nil, fmt.Errorf("gateway state: %w", err)
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	g := &Gateway{up: up, cfg: cfg, clock: clockOr(cfg.Clock), log: log, reg: prometheus.NewRegistry(),
		desk: newDesk(), answered: make(chan struct{}), ledgers: map[string]*ledger.Ledger{},
		opening: map[string]chan struct{}{}, epLocks: map[string]*sync.Mutex{}}
	buckets := prometheus.ExponentialBuckets(0.00005, 2, 18)
	g.m = gatewayMetrics{
		calls:        prometheus.NewCounterVec(prometheus.CounterOpts{Name: "stasis_gateway_calls_total", Help: "Calls answered, by status code."}, []string{"code"}),
		dedupe:       prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_dedupe_hits_total", Help: "Calls answered from the ledger without calling the model."}),
		stale:        prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_stale_attempts_total", Help: "Calls refused for a stale attempt."}),
		unauthorized: prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_unauthorized_total", Help: "Calls refused for an unknown token."}),
		bad:          prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_bad_requests_total", Help: "Malformed or oversized calls."}),
		upstream:     prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_gateway_upstream_seconds", Help: "Model server round trip.", Buckets: buckets}),
		added:        prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_gateway_added_seconds", Help: "Time in the gateway beyond the model server's round trip (ledger write included).", Buckets: buckets}),
	}
	g.m.ok = g.m.calls.WithLabelValues("200")
	g.reg.MustRegister(g.m.calls, g.m.dedupe, g.m.stale, g.m.unauthorized, g.m.bad, g.m.upstream, g.m.added,
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "stasis_gateway_ledger_flushes_total", Help: "Disk flushes made for ledger writes (in this process); writes that wait at once share one."},
			func() float64 { f, _ := ledger.Flushes(); return float64(f) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "stasis_gateway_ledger_flushed_writes_total", Help: "Ledger writes (appends and cuts, in this process) those flushes made durable."},
			func() float64 { _, w := ledger.Flushes(); return float64(w) }))
	return g, nil
}

// Close closes the ledgers.
func (g *Gateway) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []error
	for _, l := range g.ledgers {
		errs = append(errs, l.Close())
	}
	g.ledgers = map[string]*ledger.Ledger{}
	return errors.Join(errs...)
}

// Ledgers is where the episodes' ledgers are.
func (g *Gateway) Ledgers() ledger.Storage { return g.cfg.Ledgers }

// Registry is where the episodes' registrations are.
func (g *Gateway) Registry() Registry { return g.cfg.Registry }

// learn reads the registration of the episode whose token is tok into the
// desk, if there is one (another process, or another node's gateway, may
// have registered or restored it since): it runs when a token is not
// known.
func (g *Gateway) learn(tok string) {
	st, ok, err := g.cfg.Registry.ByToken(tok)
	if err != nil || !ok {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.desk.put(st)
}

// load reads one episode's registration into the desk; an episode not
// registered gives an error wrapping ErrUnknownEpisode.
func (g *Gateway) load(id string) error {
	st, err := g.cfg.Registry.Get(id)
	if err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.desk.put(st)
	return nil
}

func (g *Gateway) saveLocked(st *EpisodeState) error {
	return g.cfg.Registry.Put(*st)
}

// AddEpisode registers an episode with a fresh bearer token, attempt 0,
// and opens its ledger (creating the file), so that its first call finds
// the ledger open rather than creating it.
func (g *Gateway) AddEpisode(id string) (EpisodeState, error) {
	if !episodeName.MatchString(id) {
		return EpisodeState{}, fmt.Errorf("episode name %q: use letters, digits, '.', '_' and '-' (at most 128)", id)
	}
	if err := g.load(id); !errors.Is(err, ErrUnknownEpisode) {
		return EpisodeState{}, fmt.Errorf("episode %q already exists", id)
	}
	if _, err := g.ledger(id); err != nil {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	st := EpisodeState{Episode: id, Token: hex.EncodeToString(b), Created: g.clock.Now().UTC()}
	if err := g.saveLocked(&st); err != nil {
		return EpisodeState{}, err
	}
	g.desk.put(st)
	return st, nil
}

// Episode returns an episode's state.
func (g *Gateway) Episode(id string) (EpisodeState, error) {
	if err := g.load(id); err != nil {
		return EpisodeState{}, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	st, ok := g.desk.episode(id)
	if !ok {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	return st, nil
}

// Bind records that episode id now runs in sandbox: from now on the
// episode's token is valid on that sandbox's socket only (SandboxHandler),
// and the sandbox's socket accepts no other episode's token. An episode's
// token is never valid on a socket of another sandbox, so a token an agent
// captured is of no use from its own sandbox.
func (g *Gateway) Bind(id, sandbox string) error {
	return g.update(id, func(st *EpisodeState) { st.Sandbox = sandbox })
}

// Revoke refuses episode id's token at once, on every socket, from the
// next call on (calls already admitted finish): a retired episode makes no
// more model calls and its ledger takes no more entries. A later Restore
// of the episode (a checkpoint restored) lifts it.
func (g *Gateway) Revoke(id string) error {
	return g.update(id, func(st *EpisodeState) { st.Revoked = true })
}

// update changes and saves one episode's state under its lock.
func (g *Gateway) update(id string, change func(*EpisodeState)) error {
	unlock, err := g.lockLoaded(id)
	if err != nil {
		return err
	}
	defer unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	next, ok := g.desk.episode(id)
	if !ok {
		return fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	change(&next)
	if err := g.saveLocked(&next); err != nil {
		return err
	}
	g.desk.put(next)
	return nil
}

// Head returns the hash of the episode's ledger entry at position (""
// for 0): what a checkpoint records beside its cut, for Restore to check.
func (g *Gateway) Head(id string, position int64) (string, error) {
	if err := g.load(id); err != nil {
		return "", err
	}
	l, err := g.ledger(id)
	if err != nil {
		return "", err
	}
	if position < 0 || position > l.Len() {
		return "", fmt.Errorf("episode %q: no entry %d in its ledger of %d", id, position, l.Len())
	}
	return headOf(l, position), nil
}

func headOf(l *ledger.Ledger, position int64) string {
	e, ok := l.At(position)
	if !ok {
		return ""
	}
	return e.Hash
}

// ErrUnknownEpisode is returned for an episode the gateway has not
// registered.
var ErrUnknownEpisode = errors.New("unknown episode")

// Tip returns the episode's ledger tip: what a checkpoint records so that
// a restore of it can take the ledger back there (LedgerAt.Tip).
func (g *Gateway) Tip(id string) (ledger.Tip, error) {
	if err := g.load(id); err != nil {
		return ledger.Tip{}, err
	}
	l, err := g.ledger(id)
	if err != nil {
		return ledger.Tip{}, err
	}
	return l.Tip(), nil
}

// LedgerAt is where a checkpoint left an episode's ledger.
type LedgerAt struct {
	// Position is the cut: the relay's settled position at the pause.
	Position int64
	// Head is the hash of the entry at Position as the checkpoint saw it
	// (Head; "" when not known).
	Head string
	// Tip is the hash of the ledger's last record at the checkpoint (Tip;
	// "" when not known: a record older than tips).
	Tip string
	// Unmatched: the relay had not learned where in the ledger its
	// harness was (relaunched from a saved session, no answer since), so
	// Position (0) says nothing: an in-place restore does not cut the
	// ledger but matches the harness's next call against it, as a
	// relaunch's is (a Fork copies the whole history and matches the
	// copy's first call).
	Unmatched bool
}

// rewind takes l back to the checkpoint's history when it no longer holds
// it (an older checkpoint was restored and calls were made since): the
// ledger branches back to the checkpoint's tip. attempt is the restore's.
// It reports whether it branched.
func rewind(l *ledger.Ledger, id string, at LedgerAt, attempt int) (bool, error) {
	if at.Tip == "" || at.Tip == l.Tip().Hash {
		return false, nil
	}
	n, last, err := l.HistoryAt(at.Tip)
	if err != nil {
		return false, err
	}
	if n == 0 || headOf(l, n) == last {
		return false, nil // the checkpoint's history is still the ledger's
	}
	return true, l.Branch(at.Tip, fmt.Sprintf("restore of a checkpoint of an earlier history, attempt %d", attempt))
}

// Restore starts the episode's next attempt. Calls of older attempts are
// refused from then on, here and, where the ledger storage is shared, by
// every other gateway (the ledger is fenced with the new attempt).
//
// When the ledger no longer holds the checkpoint's history (an earlier
// checkpoint was restored and calls were made since), it first branches
// back to the checkpoint's tip (at.Tip): the entries it leaves stay in the
// ledger, readable, and a later restore can branch back to them. In place
// (the snapshot kept the harness's processes), the ledger is then cut to
// at.Position, the relay's settled position at the pause (relay_position;
// relay_delivered in acknowledgements older than it); otherwise (a
// relaunch) the next call is matched against the ledger.
//
// With at.Unmatched (the relay did not know its position), an in-place
// restore cuts nothing and matches the next call, as a relaunch does.
//
// at.Head, when not empty, is the hash of the ledger's entry at
// at.Position as the checkpoint saw it (Head). An in-place restore onto a
// ledger whose entry there is another even so (no tip to branch to: a
// record older than tips) is refused with errdefs.ErrConflict and cuts
// nothing: the harness would resume a conversation the ledger no longer
// holds.
func (g *Gateway) Restore(id string, inPlace bool, at LedgerAt) (EpisodeState, error) {
	if err := g.load(id); err != nil {
		return EpisodeState{}, err
	}
	l, err := g.freshLedger(id)
	if err != nil {
		return EpisodeState{}, err
	}
	lock := g.epLock(id)
	lock.Lock()
	defer lock.Unlock()
	g.mu.Lock()
	st, ok := g.desk.episode(id)
	g.mu.Unlock()
	if !ok {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	if inPlace {
		if at.Position < 0 {
			return EpisodeState{}, fmt.Errorf("episode %q: cannot cut its ledger to %d", id, at.Position)
		}
	}
	if at.Tip != "" && !l.Has(at.Tip) {
		return EpisodeState{}, errdefs.Errorf(errdefs.ErrConflict, "episode %q: the checkpoint's ledger tip %.12s… is not a record of this episode's ledger: the record belongs to another ledger; nothing was changed", id, at.Tip)
	}
	if err := l.Fence(st.Attempt + 1); err != nil {
		g.dropLedger(id, l, err)
		return EpisodeState{}, err
	}
	if _, err := rewind(l, id, at, st.Attempt+1); err != nil {
		return EpisodeState{}, err
	}
	cut := inPlace && !at.Unmatched
	if cut {
		if at.Position > l.Len() {
			return EpisodeState{}, fmt.Errorf("episode %q: cannot cut its ledger of %d entries to %d", id, l.Len(), at.Position)
		}
		if got := headOf(l, at.Position); at.Head != "" && got != at.Head {
			return EpisodeState{}, errdefs.Errorf(errdefs.ErrConflict, "episode %q: its ledger's entry %d is not the one this checkpoint's harness received (hash %.12s, the checkpoint saw %.12s): the ledger has moved on from that history (an earlier checkpoint was restored and calls were made since), and the checkpoint's record has no ledger tip to branch back to, so the episode cannot resume in place on it; nothing was cut", id, at.Position, got, at.Head)
		}
		if err := l.Cut(at.Position, fmt.Sprintf("restore in place, attempt %d", st.Attempt+1)); err != nil {
			return EpisodeState{}, err
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	// The state now (a reload may have read it again meanwhile); st is
	// what the cut was made for, and the episode lock kept it so.
	next, _ := g.desk.episode(id)
	next.Attempt = st.Attempt + 1
	next.NeedMatch = !cut
	next.Revoked = false
	if err := g.saveLocked(&next); err != nil {
		return EpisodeState{}, err
	}
	g.desk.put(next)
	return next, nil
}

// Rewind takes the episode's ledger back to a checkpoint's history, the
// ledger as it was right after the record with hash tip, when it has
// moved on since (as Restore does, without starting an attempt): a
// restore of a checkpoint that recorded the episode finished brings back
// the history its verdict was made on. A tip the ledger does not hold is
// refused with errdefs.ErrConflict, and nothing changes.
func (g *Gateway) Rewind(id, tip string) error {
	if err := g.load(id); err != nil {
		return err
	}
	l, err := g.freshLedger(id)
	if err != nil {
		return err
	}
	lock := g.epLock(id)
	lock.Lock()
	defer lock.Unlock()
	if !l.Has(tip) {
		return errdefs.Errorf(errdefs.ErrConflict, "episode %q: the checkpoint's ledger tip %.12s… is not a record of this episode's ledger; nothing was changed", id, tip)
	}
	g.mu.Lock()
	st, ok := g.desk.episode(id)
	g.mu.Unlock()
	if !ok {
		return fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	// Written as the episode's attempt now, which may be another node's.
	if err := l.Fence(st.Attempt); err != nil {
		g.dropLedger(id, l, err)
		return err
	}
	_, err = rewind(l, id, LedgerAt{Tip: tip}, st.Attempt)
	return err
}

// Restart starts the episode's next attempt from the start: a trainer
// starts a retired or lost episode again, a new harness on the task's
// work tree. Calls of older attempts are refused from then on, here and by
// every gateway sharing the ledger (it is fenced with the new attempt),
// and the ledger goes back to its start (ledger.Ledger.Restart), so that
// the new attempt's calls are its whole history: the earlier entries stay
// in the ledger, dropped, and a restore of a checkpoint of them branches
// back to them. The token stays; Bind names the new sandbox.
func (g *Gateway) Restart(id string) (EpisodeState, error) {
	if err := g.load(id); err != nil {
		return EpisodeState{}, err
	}
	l, err := g.freshLedger(id)
	if err != nil {
		return EpisodeState{}, err
	}
	lock := g.epLock(id)
	lock.Lock()
	defer lock.Unlock()
	g.mu.Lock()
	st, ok := g.desk.episode(id)
	g.mu.Unlock()
	if !ok {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	if err := l.Fence(st.Attempt + 1); err != nil {
		g.dropLedger(id, l, err)
		return EpisodeState{}, err
	}
	if err := l.Restart(fmt.Sprintf("restart from the task as attempt %d", st.Attempt+1)); err != nil {
		return EpisodeState{}, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	next, _ := g.desk.episode(id)
	next.Attempt = st.Attempt + 1
	next.NeedMatch = false
	next.Revoked = false
	if err := g.saveLocked(&next); err != nil {
		return EpisodeState{}, err
	}
	g.desk.put(next)
	return next, nil
}

// Fork registers episode dst as a copy of src's history at a checkpoint,
// up to at.Position: dst gets its own token and a ledger holding those
// entries of src's (appended anew, so under dst's own hash chain), and
// src's attempt, so that a Restore of dst starts a newer one. It is how one
// checkpointed episode continues as several (a fork of N), each with its
// own ledger. The history is src's at at.Tip when given (whatever src's
// ledger holds now), its current one otherwise; at.Head, when given, must
// be the entry at at.Position in it (errdefs.ErrConflict otherwise). With
// at.Unmatched the copy takes the whole history.
func (g *Gateway) Fork(src, dst string, at LedgerAt) (EpisodeState, error) {
	if err := g.load(src); err != nil {
		return EpisodeState{}, err
	}
	l, err := g.freshLedger(src)
	if err != nil {
		return EpisodeState{}, err
	}
	entries := l.Entries()
	if at.Tip != "" {
		if !l.Has(at.Tip) {
			return EpisodeState{}, errdefs.Errorf(errdefs.ErrConflict, "episode %q: the checkpoint's ledger tip %.12s… is not a record of its ledger", src, at.Tip)
		}
		if entries, err = l.EntriesAt(at.Tip); err != nil {
			return EpisodeState{}, err
		}
	}
	upTo := at.Position
	if at.Unmatched {
		// Where the harness is in that history is not known: the copy
		// takes all of it, and its first call is matched against it
		// (Restore of the copy, which at.Unmatched makes match).
		upTo, at.Head = int64(len(entries)), ""
	}
	if upTo < 0 || upTo > int64(len(entries)) {
		return EpisodeState{}, fmt.Errorf("episode %q: cannot fork its ledger of %d entries at %d", src, len(entries), upTo)
	}
	if at.Head != "" && (upTo == 0 || entries[upTo-1].Hash != at.Head) {
		return EpisodeState{}, errdefs.Errorf(errdefs.ErrConflict, "episode %q: its ledger's entry %d is no longer the one this checkpoint's harness received: the ledger has moved on from that history", src, upTo)
	}
	if _, err := g.AddEpisode(dst); err != nil {
		return EpisodeState{}, err
	}
	dl, err := g.ledger(dst)
	if err != nil {
		return EpisodeState{}, err
	}
	var settled []ledger.Settlement
	for _, e := range entries[:upTo] {
		disp := e.Disposition
		e.Seq, e.Parent, e.Hash, e.Disposition = 0, "", "", ""
		c, err := dl.Append(e)
		if err != nil {
			return EpisodeState{}, fmt.Errorf("episode %q: copy %s's entry %s: %w", dst, src, e.CallID, err)
		}
		if disp == ledger.Delivered || disp == ledger.Abandoned {
			settled = append(settled, ledger.Settlement{Seq: c.Seq, CallID: c.CallID, Disposition: disp})
		}
	}
	if len(settled) > 0 {
		if err := dl.Settle(settled...); err != nil {
			return EpisodeState{}, fmt.Errorf("episode %q: copy %s's dispositions: %w", dst, src, err)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	next, _ := g.desk.episode(dst)
	from, _ := g.desk.episode(src)
	next.Attempt = from.Attempt
	next.Revoked = false
	if err := g.saveLocked(&next); err != nil {
		return EpisodeState{}, err
	}
	g.desk.put(next)
	return next, nil
}

func (g *Gateway) epLock(id string) *sync.Mutex {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.epLocks[id]
	if !ok {
		l = &sync.Mutex{}
		g.epLocks[id] = l
	}
	return l
}

// lockLoaded loads the episode, if it is not, and takes its lock; unlock
// lets it go.
func (g *Gateway) lockLoaded(id string) (unlock func(), err error) {
	if err := g.load(id); err != nil {
		return nil, err
	}
	l := g.epLock(id)
	l.Lock()
	return l.Unlock, nil
}

// Remove forgets an episode: its registration, its token and its ledger
// file. It is for undoing a copy that Fork made and a failed restore never
// installed; an episode a store still names must not be removed.
func (g *Gateway) Remove(id string) error {
	unlock, err := g.lockLoaded(id)
	if err != nil {
		return err
	}
	defer unlock()
	g.mu.Lock()
	l := g.ledgers[id]
	delete(g.ledgers, id)
	g.desk.remove(id)
	g.mu.Unlock()
	var errs []error
	if l != nil {
		errs = append(errs, l.Close())
	}
	if err := g.cfg.Ledgers.Remove(id); err != nil {
		errs = append(errs, err)
	}
	if err := g.cfg.Registry.Remove(id); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// freshLedger is the episode's open ledger as its storage holds it now:
// where the storage is shared, another node's gateway may have written it
// since this one opened it (the episode ran there, and now a restore or
// a restart brings it here), and what this gateway decides from it must
// be of the ledger as it is.
func (g *Gateway) freshLedger(id string) (*ledger.Ledger, error) {
	l, err := g.ledger(id)
	if err != nil {
		return nil, err
	}
	if err := l.Refresh(); err != nil {
		return nil, err
	}
	return l, nil
}

// ledger returns the episode's open ledger, opening it on its first call.
// The open (a file created, its directory fsync'd, an old file read and
// checked) happens outside g.mu, so one episode's first call does not stall
// every other episode's calls; a second caller for the same episode waits
// for the first one's open.
func (g *Gateway) ledger(id string) (*ledger.Ledger, error) {
	for {
		g.mu.Lock()
		if l, ok := g.ledgers[id]; ok {
			if l.Err() == nil {
				g.mu.Unlock()
				return l, nil
			}
			// A write it refused for good: open it afresh.
			delete(g.ledgers, id)
			l.Close()
		}
		if ch, ok := g.opening[id]; ok {
			g.mu.Unlock()
			<-ch
			continue
		}
		ch := make(chan struct{})
		g.opening[id] = ch
		g.mu.Unlock()
		l, err := g.openLedger(id)
		g.mu.Lock()
		delete(g.opening, id)
		close(ch)
		if err == nil {
			g.ledgers[id] = l
		}
		g.mu.Unlock()
		return l, err
	}
}

// openLedger opens an episode's ledger and fences it with the episode's
// attempt: this gateway writes it for that attempt, and a gateway of an
// older one (on another node that lost the episode) can write no more.
func (g *Gateway) openLedger(id string) (*ledger.Ledger, error) {
	l, err := ledger.OpenIn(g.cfg.Ledgers, id)
	if err != nil {
		return nil, err
	}
	g.mu.Lock()
	st, _ := g.desk.episode(id)
	g.mu.Unlock()
	if err := l.Fence(st.Attempt); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// dropLedger forgets an episode's open ledger after a write it refused for
// good (it lost the episode to a newer attempt, or a flush failed), so
// that the next call opens it afresh and finds out where it stands.
func (g *Gateway) dropLedger(id string, l *ledger.Ledger, err error) {
	if !errors.Is(err, ledger.ErrFenced) && !errors.Is(err, ledger.ErrUnflushed) {
		return
	}
	g.mu.Lock()
	if g.ledgers[id] == l {
		delete(g.ledgers, id)
	}
	g.mu.Unlock()
	l.Close()
	g.log.Warn("ledger dropped after a refused write; the next call opens it again", "episode", id, "err", err)
}

// Handler serves the relays: the OpenAI-compatible endpoints, /metrics and
// /healthz.
func (g *Gateway) Handler() http.Handler { return mux(g.routes()) }

// Metrics gathers the gateway's Prometheus metrics (those its /metrics
// serves), for a server that shows them elsewhere.
func (g *Gateway) Metrics() prometheus.Gatherer { return g.reg }

// SandboxHandler is Handler for one sandbox's own socket: only the token
// of the episode bound to that sandbox (Bind) is valid on it.
func (g *Gateway) SandboxHandler(sandbox string) http.Handler {
	h := g.Handler()
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		h.ServeHTTP(w, q.WithContext(context.WithValue(q.Context(), socketKey{}, sandbox)))
	})
}

// socketKey is the context key of the sandbox whose socket a request came
// in on (SandboxHandler).
type socketKey struct{}

// Routes lists the operations the handler serves ("METHOD /path").
func (g *Gateway) Routes() []string { return keys(g.routes()) }

func (g *Gateway) routes() map[string]http.Handler {
	r := apiRoutes(g.serveCall, g.serveModels, g.reg, openapi.Gateway)
	r["POST "+settlePath] = http.HandlerFunc(g.serveSettle)
	return r
}

// request reads what the desk judges of a relay's request. The first time
// its token is not known, the episode files are read again (the episode
// may have been registered by another process since).
func (g *Gateway) request(q *http.Request) request {
	r := request{authorization: q.Header.Get("Authorization"), attempt: q.Header.Get(HeaderAttempt), callID: q.Header.Get(HeaderCallID)}
	r.sandbox, r.onSocket = q.Context().Value(socketKey{}).(string)
	tok, ok := strings.CutPrefix(r.authorization, "Bearer ")
	if ok && tok != "" {
		g.mu.Lock()
		known := g.desk.knows(tok)
		g.mu.Unlock()
		if !known {
			g.learn(tok)
		}
	}
	return r
}

// refuse writes a refusal and counts it.
func (g *Gateway) refuse(w http.ResponseWriter, r *refusal) {
	switch r.kind {
	case refusedUnauthorized:
		g.m.unauthorized.Inc()
	case refusedBad:
		g.m.bad.Inc()
	case refusedStale:
		g.m.stale.Inc()
	}
	g.m.calls.WithLabelValues(strconv.Itoa(r.status)).Inc()
	apiError(w, r.status, r.typ, r.msg)
}

// requestHash fingerprints a request body in the compact form the ledger
// stores it in.
func requestHash(b []byte) string {
	if c, err := json.Marshal(json.RawMessage(b)); err == nil {
		b = c
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// gatewayCall is a model call the desk admitted.
type gatewayCall struct {
	st      EpisodeState
	path    string
	callID  string
	key     string // among the calls being answered
	body    []byte
	started time.Time
	l       *ledger.Ledger
	// settled are the settlements of earlier calls riding on this one:
	// recorded with its entry (one write, one flush), or alone when no
	// entry is appended.
	settled []ledger.Settlement
}

func (g *Gateway) serveCall(w http.ResponseWriter, q *http.Request, path string) {
	c, ok := g.receive(w, q, path)
	if !ok {
		return
	}
	// One answer per call id at a time: a duplicate arriving while the first
	// is being answered waits for it, then is answered from the ledger.
	if !g.claim(q.Context(), c.key) {
		return
	}
	defer g.unclaim(c.key)
	// A relaunched harness re-sends its conversation: match it against the
	// ledger first (which cuts what it never acted on), then dedupe.
	if g.desk.needsMatch(c.st, path) {
		g.match(c)
	}
	var err error
	c.settled, err = g.settlements(c.st.Episode, c.l, q.Header.Get(HeaderSettled))
	if err != nil {
		g.log.Warn("bad settlements from a relay", "episode", c.st.Episode, "err", err)
	}
	if e, ok := c.l.Lookup(c.callID); ok {
		g.settleAlone(w, c)
		if ref := g.desk.replay(c.callID, e.Request, c.body); ref != nil {
			g.refuse(w, ref)
			return
		}
		g.m.dedupe.Inc()
		g.answer(w, c.l, e, q)
		return
	}
	g.callModel(w, q, c)
}

// receive admits a model call and reads its body; a refusal is written
// when it is not admitted.
func (g *Gateway) receive(w http.ResponseWriter, q *http.Request, path string) (*gatewayCall, bool) {
	c := &gatewayCall{path: path, started: g.clock.Now()}
	r, st, ok := g.admit(w, q, (*desk).admitCall)
	if !ok {
		return nil, false
	}
	body, err := readAll(http.MaxBytesReader(w, q.Body, g.cfg.MaxBody), q.ContentLength)
	if ref := g.desk.checkBody(body, err, g.cfg.MaxBody); ref != nil {
		g.refuse(w, ref)
		return nil, false
	}
	l, ok := g.episodeLedger(w, st.Episode)
	if !ok {
		return nil, false
	}
	c.st, c.callID, c.body, c.l = st, r.callID, body, l
	c.key = callKey(st.Episode, r.callID)
	return c, true
}

// admit reads q as the desk judges it (request) and puts it to check, the
// desk's authenticate, admit or admitCall, under the gateway's lock; the
// refusal is written when q is not admitted.
func (g *Gateway) admit(w http.ResponseWriter, q *http.Request, check func(*desk, request) (EpisodeState, *refusal)) (request, EpisodeState, bool) {
	r := g.request(q)
	g.mu.Lock()
	st, ref := check(g.desk, r)
	g.mu.Unlock()
	if ref != nil {
		g.refuse(w, ref)
		return r, st, false
	}
	return r, st, true
}

// episodeLedger is the episode's ledger, opened if it is not; a server
// error is written when it cannot be.
func (g *Gateway) episodeLedger(w http.ResponseWriter, episode string) (*ledger.Ledger, bool) {
	l, err := g.ledger(episode)
	if err != nil {
		g.refuse(w, serverError(err.Error()))
		return nil, false
	}
	return l, true
}

// claim waits until the desk lets the call named key be answered; false
// when the client went first.
func (g *Gateway) claim(ctx context.Context, key string) bool {
	for {
		g.mu.Lock()
		if g.desk.claim(key) {
			g.mu.Unlock()
			return true
		}
		ch := g.answered
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
}

// unclaim ends a claim and wakes the duplicates waiting.
func (g *Gateway) unclaim(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.desk.done(key)
	close(g.answered)
	g.answered = make(chan struct{})
}

// match matches a relaunched episode's call against its ledger, which
// cuts the ledger to the longest matching prefix (or marks the history
// broken), and records that the match is made.
func (g *Gateway) match(c *gatewayCall) {
	var reqObj struct {
		Messages []json.RawMessage `json:"messages"`
	}
	_ = json.Unmarshal(c.body, &reqObj)
	lock := g.epLock(c.st.Episode)
	lock.Lock()
	defer lock.Unlock()
	_, merr := c.l.Match(reqObj.Messages)
	g.mu.Lock()
	if st, ok := g.desk.matched(c.st.Episode, c.st.Attempt); ok {
		_ = g.saveLocked(&st)
	}
	g.mu.Unlock()
	if merr != nil {
		g.log.Warn("relaunch does not match the ledger: history marked broken", "episode", c.st.Episode, "err", merr)
	}
}

// settleAlone records the settlements riding on a call that appends no
// entry.
func (g *Gateway) settleAlone(w http.ResponseWriter, c *gatewayCall) {
	if err := settleAlone(w, c.l, c.settled); err != nil {
		g.log.Warn("settlements not recorded", "episode", c.st.Episode, "err", err)
	}
}

// callModel forwards a call the ledger does not hold to the model server,
// records its response and answers from the entry; what the model refuses
// is passed on, unrecorded.
func (g *Gateway) callModel(w http.ResponseWriter, q *http.Request, c *gatewayCall) {
	t0 := g.clock.Now()
	status, header, respBody, buf, err := g.forward(q.Context(), c.path, c.body)
	// The ledger keeps its own copy of the answer, so the buffer it was
	// read into goes back to the pool when this call is answered.
	defer releaseBody(buf)
	upTime := g.clock.Now().Sub(t0)
	g.m.upstream.Observe(upTime.Seconds())
	out, respBody, ref := g.desk.judge(err, status, header.Get("Content-Type"), respBody)
	switch out {
	case outcomeRefuse:
		g.settleAlone(w, c)
		g.refuse(w, ref)
		return
	case outcomePassOn:
		g.settleAlone(w, c)
		g.m.calls.WithLabelValues(strconv.Itoa(status)).Inc()
		for _, h := range []string{"Content-Type", "Retry-After"} {
			if v := header.Get(h); v != "" {
				w.Header().Set(h, v)
			}
		}
		w.WriteHeader(status)
		_, _ = w.Write(respBody)
		return
	}
	e, serr, err := c.l.SettleAndAppend(c.settled, ledger.Entry{
		// Usage and tokens are read from the response by the ledger.
		CallID: c.callID, Attempt: c.st.Attempt, Request: c.body, Response: respBody, Started: t0, Finished: g.clock.Now(),
	})
	if serr != nil {
		g.log.Warn("settlements not recorded", "episode", c.st.Episode, "err", serr)
	}
	if err != nil {
		g.log.Error("ledger append failed", "episode", c.st.Episode, "call", c.callID, "err", err)
		g.dropLedger(c.st.Episode, c.l, err)
		if errors.Is(err, ledger.ErrFenced) {
			// A newer attempt has the episode (on this node or another):
			// this call is of a dead attempt, as the desk would say.
			g.m.stale.Inc()
			g.refuse(w, &refusal{http.StatusConflict, "stale_attempt", "ledger: " + err.Error(), refusedStale})
			return
		}
		g.refuse(w, serverError("ledger: "+err.Error()))
		return
	}
	w.Header().Set(HeaderSettledOK, "1")
	g.answer(w, c.l, e, q)
	g.m.added.Observe((g.clock.Now().Sub(c.started) - upTime).Seconds())
}

func (g *Gateway) answer(w http.ResponseWriter, l *ledger.Ledger, e ledger.Entry, q *http.Request) {
	g.m.ok.Inc()
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(e.Response)))
	h.Set(HeaderLedgerSeq, strconv.FormatInt(e.Seq, 10))
	if q.Header.Get(HeaderWantBase) != "" {
		h.Set(HeaderDeliveredBefore, strconv.FormatInt(l.DeliveredBefore(e.Seq), 10))
	}
	_, _ = w.Write(e.Response)
}

// settlements reads the settlements a relay sent (an error for a
// malformed header) and keeps those that name a live entry of the ledger;
// the others (entries a cut took away) are logged and dropped.
func (g *Gateway) settlements(episode string, l *ledger.Ledger, h string) ([]ledger.Settlement, error) {
	all, err := ParseSettlements(episode, h)
	if err != nil || len(all) == 0 {
		return nil, err
	}
	keep := all[:0]
	for _, s := range all {
		if s.CallID == "" { // an answer no call of the relay read: by position
			if e, ok := l.At(s.Seq); ok {
				s.CallID = e.CallID
			}
		}
		if e, ok := l.Lookup(s.CallID); ok && e.Seq == s.Seq {
			keep = append(keep, s)
		} else {
			g.log.Warn("settlement of an entry not in the ledger: dropped", "episode", episode, "seq", s.Seq, "call", s.CallID)
		}
	}
	return keep, nil
}

// settleAlone records settlements that no entry carries and, once they
// are recorded (or there are none), says so on the answer.
func settleAlone(w http.ResponseWriter, l *ledger.Ledger, s []ledger.Settlement) error {
	if err := l.Settle(s...); err != nil {
		return err
	}
	w.Header().Set(HeaderSettledOK, "1")
	return nil
}

// serveSettle records settlements that had no call to ride on.
func (g *Gateway) serveSettle(w http.ResponseWriter, q *http.Request) {
	_, st, ok := g.admit(w, q, (*desk).admit)
	if !ok {
		return
	}
	l, ok := g.episodeLedger(w, st.Episode)
	if !ok {
		return
	}
	s, err := g.settlements(st.Episode, l, q.Header.Get(HeaderSettled))
	if err != nil {
		g.refuse(w, &refusal{http.StatusBadRequest, "invalid_request_error", err.Error(), refusedOther})
		return
	}
	if err := settleAlone(w, l, s); err != nil {
		g.dropLedger(st.Episode, l, err)
		g.refuse(w, &refusal{http.StatusConflict, "invalid_settlement", err.Error(), refusedOther})
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (g *Gateway) forward(ctx context.Context, path string, body []byte) (int, http.Header, []byte, *[]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.up.Base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if g.cfg.ModelKey != "" {
		req.Header.Set("Authorization", "Bearer "+g.cfg.ModelKey)
	}
	resp, err := g.up.Client.Do(req)
	if err != nil {
		return 0, nil, nil, nil, fmt.Errorf("model server %s: %w", g.up.Base, err)
	}
	defer resp.Body.Close()
	b, buf, err := readPooled(io.LimitReader(resp.Body, maxResponse+1), resp.ContentLength)
	if err != nil {
		releaseBody(buf)
		return 0, nil, nil, nil, fmt.Errorf("model server %s: read: %w", g.up.Base, err)
	}
	if len(b) > maxResponse {
		releaseBody(buf)
		return 0, nil, nil, nil, fmt.Errorf("model server answer over %d bytes", maxResponse)
	}
	return resp.StatusCode, resp.Header, b, buf, nil
}

func (g *Gateway) serveModels(w http.ResponseWriter, q *http.Request) {
	if _, _, ok := g.admit(w, q, (*desk).authenticate); !ok {
		return
	}
	h := map[string]string{}
	if g.cfg.ModelKey != "" {
		h["Authorization"] = "Bearer " + g.cfg.ModelKey
	}
	proxyGet(w, q, g.up, "/v1/models", h)
}
