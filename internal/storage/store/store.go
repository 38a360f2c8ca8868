// Package store owns stasis's durable checkpoint state: the per-episode
// Record document and the record store, in which a checkpoint is begun,
// filled with one record per episode, and committed in one atomic step, so
// that a checkpoint shows as committed only once every record is durable and
// a failed or interrupted save leaves the previous committed checkpoint
// untouched. It also keeps what any server on the store needs about each
// episode (its sandbox, attempt, state) and each episode's verify verdict,
// written once, and the journal of the coordinator's operations under way
// (what a prepare or a restore is about to create, so that the next server
// finishes or undoes it). SQLite is the default record store; PostgreSQL
// runs the same portable SQL for several servers sharing one state, and
// there also keeps the nodes of a cluster (their leases), checkpoints over
// several nodes (one share each) and restores over them.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/home"
	"stasis/internal/storage/dburl"
)

// State is where a checkpoint is in its life.
type State string

// The states of a checkpoint. A checkpoint is begun pending; Commit makes it
// committed, or failed when its records are not all there and valid; Fail
// and RecoverPending make a pending one failed. Nothing leaves committed or
// failed except by Delete.
const (
	StatePending   State = "pending"
	StateCommitted State = "committed"
	StateFailed    State = "failed"
)

// Checkpoint is one checkpoint's header, without its records.
type Checkpoint struct {
	ID        string          `json:"id"`
	Created   time.Time       `json:"created"`
	State     State           `json:"state"`
	Manifest  json.RawMessage `json:"manifest,omitempty"`
	Error     string          `json:"error,omitempty"`     // why it failed
	Episodes  int             `json:"episodes"`            // the records it holds
	Committed *time.Time      `json:"committed,omitempty"` // when it was committed
}

// SnapshotRef names one snapshot of one provider.
type SnapshotRef struct {
	Provider   string `json:"provider"`
	SnapshotID string `json:"snapshot_id"`
}

func (r SnapshotRef) String() string { return r.Provider + "/" + r.SnapshotID }

// ListOptions selects checkpoints for List: State "" means every state,
// Limit 0 means no limit.
type ListOptions struct {
	State State
	Limit int
}

// Store keeps checkpoints and their records durably.
//
// A save is Begin, one Put per episode (in parallel if wanted), then Commit,
// which in one transaction checks that exactly the expected records are there
// and valid and flips the checkpoint to committed, or marks it failed. Order
// is by creation: List is newest first and Latest is the newest committed.
type Store interface {
	// Begin creates a pending checkpoint; an id already used is refused
	// with errdefs.ErrExists. manifest, if not empty, must be valid JSON.
	Begin(ctx context.Context, id string, manifest json.RawMessage) error
	// Put stores the record of one episode into a pending checkpoint
	// (errdefs.ErrConflict otherwise); a second Put for the same episode replaces it.
	// The record is validated as DecodeRecord validates it.
	Put(ctx context.Context, id string, rec Record) error
	// Commit checks that exactly expectEpisodes valid records are there and
	// makes the checkpoint committed, in one transaction. Otherwise it marks
	// the checkpoint failed and returns the reason (ErrIncomplete).
	Commit(ctx context.Context, id string, expectEpisodes int) error
	// Fail marks a pending checkpoint failed with reason; a failed one
	// stays as it is, a committed one is refused with errdefs.ErrConflict.
	Fail(ctx context.Context, id, reason string) error
	// Get returns a checkpoint and its records, sorted by episode.
	Get(ctx context.Context, id string) (Checkpoint, []Record, error)
	// List returns checkpoints, newest first.
	List(ctx context.Context, opts ListOptions) ([]Checkpoint, error)
	// Latest returns the newest committed checkpoint (errdefs.ErrNotFound if none).
	Latest(ctx context.Context) (Checkpoint, error)
	// Delete removes a committed or failed checkpoint and its records and
	// returns the snapshots that no remaining checkpoint references, which
	// the caller should now delete. A pending one is refused with errdefs.ErrConflict:
	// a save may still be writing it; Fail it first.
	Delete(ctx context.Context, id string) (freed []SnapshotRef, err error)
	// RecoverPending marks failed every checkpoint still pending that began
	// at least olderThan ago: a save interrupted by a crash. It returns
	// their ids, oldest first.
	RecoverPending(ctx context.Context, olderThan time.Duration) (failed []string, err error)
	// PutVerdict records the verify result (a JSON document) of one attempt
	// of an episode once: the first call stores doc and returns it with
	// created true; every later call for that attempt, from any process,
	// returns the document stored first and created false, and changes
	// nothing. A restore starts a new attempt, whose verdict is its own.
	PutVerdict(ctx context.Context, episode string, attempt int, doc json.RawMessage) (stored json.RawMessage, created bool, err error)
	// GetVerdict returns the recorded verify result of an episode's
	// attempt, or an error matching errdefs.ErrNotFound when none is recorded.
	GetVerdict(ctx context.Context, episode string, attempt int) (json.RawMessage, error)
	// PutEpisode creates or replaces an episode; GetEpisode finds one
	// (errdefs.ErrNotFound); ListEpisodes lists those in a state ("" for all),
	// oldest first.
	PutEpisode(ctx context.Context, e Episode) error
	// PutEpisodes is PutEpisode for many, in one transaction.
	PutEpisodes(ctx context.Context, es []Episode) error
	GetEpisode(ctx context.Context, id string) (Episode, error)
	ListEpisodes(ctx context.Context, state EpisodeState) ([]Episode, error)
	// AppendJournal appends an entry to the journal of the operations
	// under way, durably, and returns it with its Seq and Created set.
	// An operation journals each step before it takes it.
	AppendJournal(ctx context.Context, e JournalEntry) (JournalEntry, error)
	// Journal returns the entries of every operation not yet closed, in
	// the order they were appended.
	Journal(ctx context.Context) ([]JournalEntry, error)
	// CloseJournal ends operation op: in one transaction its entries are
	// removed and the episodes es (none, or what the operation leaves)
	// are put as PutEpisodes puts them. Closing an operation that has no
	// entries puts es and changes nothing else.
	CloseJournal(ctx context.Context, op string, es []Episode) error
	// Close releases the store.
	Close() error
}

// The errors of a Store are of package errdefs's kinds, wrapped in
// messages that name the checkpoint or episode: errdefs.ErrNotFound,
// errdefs.ErrExists (an id used before), errdefs.ErrConflict (the row's
// state forbids the change), and ErrIncomplete. Test for them with
// errors.Is.

// ErrIncomplete refuses a commit whose records are missing or invalid; it
// is a conflict.
var ErrIncomplete = errdefs.Errorf(errdefs.ErrConflict, "records missing or invalid")

// FileName is the record store's file in the state directory.
const FileName = "store.db"

// DefaultPath is where Open keeps the record store: $STASIS_HOME/store.db.
func DefaultPath() (string, error) {
	d, err := home.Dir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, FileName), nil
}

// Open opens the default record store, the SQLite database at DefaultPath,
// creating it if missing.
func Open(ctx context.Context) (Store, error) {
	p, err := DefaultPath()
	if err != nil {
		return nil, err
	}
	return openSQLite(ctx, p)
}

// OpenAt opens the record store at location: a PostgreSQL database when it
// is a postgres:// or postgresql:// URL, otherwise the SQLite database file
// at that path (created if missing).
func OpenAt(ctx context.Context, location string) (Store, error) {
	if dburl.IsPostgres(location) {
		return OpenPostgres(ctx, location)
	}
	if strings.Contains(location, "://") {
		return nil, fmt.Errorf("record store %q: unknown kind of URL: give a postgres:// URL or the path of an SQLite file", location)
	}
	return openSQLite(ctx, location)
}

// checkID refuses checkpoint ids that would be awkward on a command line or
// in a file name.
func checkID(id string) error {
	if id == "" {
		return errors.New("checkpoint id is empty: give it a name such as ckpt-000042")
	}
	if len(id) > 200 {
		return fmt.Errorf("checkpoint id %.40q... is %d bytes long: use at most 200", id, len(id))
	}
	for _, c := range id {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '-' || c == '_' || c == '.' || c == ':' || c == '@' || c == '+'
		if !ok {
			return fmt.Errorf("checkpoint id %q has the character %q: use letters, digits and - _ . : @ +", id, c)
		}
	}
	return nil
}
