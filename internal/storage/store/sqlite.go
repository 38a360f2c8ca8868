package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"modernc.org/sqlite" // the "sqlite" database/sql driver, pure Go
	sqlite3 "modernc.org/sqlite/lib"
)

// SQLite is the record store in one SQLite database file: write-ahead
// logging, synchronous=FULL (every committed transaction is fsync'd before
// the commit returns), a busy timeout so that processes sharing the file take
// turns, and write transactions that begin IMMEDIATE, taking the write lock
// before they read.
type SQLite struct {
	sqlStore
	path string
}

var _ Store = (*SQLite)(nil)

// busyTimeout is how long a write waits for another process's write
// transaction on the same file before it fails.
const busyTimeout = 30 * time.Second

// OpenSQLite opens the record store at path, creating the file and its schema
// if missing and migrating an older schema; doing so twice changes nothing.
func OpenSQLite(path string) (*SQLite, error) {
	return openSQLite(context.Background(), path)
}

func openSQLite(ctx context.Context, path string) (*SQLite, error) {
	if path == "" {
		return nil, fmt.Errorf("record store: the database path is empty")
	}
	if strings.ContainsRune(path, '?') {
		return nil, fmt.Errorf("record store %s: the path contains '?', which SQLite would read as options: choose another path", path)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("record store %s: %w", path, err)
	}
	dsn := fmt.Sprintf("%s?_txlock=immediate&_pragma=busy_timeout(%d)&_pragma=journal_mode(WAL)&_pragma=synchronous(FULL)&_pragma=foreign_keys(1)",
		abs, busyTimeout.Milliseconds())
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("record store %s: %w", abs, err)
	}
	s := &SQLite{sqlStore: sqlStore{db: db, d: sqliteDialect, where: abs, now: time.Now}, path: abs}
	if err := s.check(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	return s, nil
}

// check opens the first connection, checks its settings and migrates.
func (s *SQLite) check(ctx context.Context) error {
	if err := s.firstConnection(ctx); err != nil {
		return fmt.Errorf("record store %s: %w; check that its directory exists and is writable", s.path, err)
	}
	var mode string
	if err := s.db.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
		return s.wrap(err)
	}
	if !strings.EqualFold(mode, "wal") {
		return fmt.Errorf("record store %s: journal mode is %q, not wal: the file system may not support SQLite's write-ahead log; put $STASIS_HOME on a local file system", s.path, mode)
	}
	return s.migrate(ctx)
}

// firstConnection opens a connection, which applies the DSN's pragmas. The
// first process to open a new file turns it to write-ahead logging, which
// needs the file to itself; SQLite reports a process opening the file at that
// moment as busy without calling its busy handler (it would deadlock waiting
// otherwise). Such an open is tried again, with a growing pause, until the
// busy timeout has passed.
func (s *SQLite) firstConnection(ctx context.Context) error {
	deadline := time.Now().Add(busyTimeout)
	pause := 5 * time.Millisecond
	for {
		err := s.db.PingContext(ctx)
		if err == nil || !busy(err) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 250*time.Millisecond)
	}
}

// busy tells whether err is SQLite's SQLITE_BUSY, of any extended kind.
func busy(err error) bool {
	var e *sqlite.Error
	return errors.As(err, &e) && e.Code()&0xff == sqlite3.SQLITE_BUSY
}

// Path is the database file.
func (s *SQLite) Path() string { return s.path }
