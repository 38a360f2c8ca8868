package store

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	_ "modernc.org/sqlite" // the "sqlite" database/sql driver, pure Go
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
	if err := s.db.PingContext(ctx); err != nil {
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

// Path is the database file.
func (s *SQLite) Path() string { return s.path }
