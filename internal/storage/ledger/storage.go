package ledger

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"stasis/internal/storage/atomicfile"
)

// Storage keeps the ledgers' bytes: Files, one file per episode in a
// directory (the default, on one host), or Postgres, rows in a PostgreSQL
// database that the gateways of many nodes share. Either holds exactly the
// lines this package writes; everything else (hashes, parents, the logical
// ledger) is worked out from those bytes the same way.
type Storage interface {
	// Where names an episode's ledger in messages (its file, or the
	// database and the episode).
	Where(episode string) string
	// OpenLog opens an episode's ledger for appending, creating an empty
	// one when there is none, and returns what it holds.
	OpenLog(episode string) (Log, []byte, error)
	// ReadAll returns what an episode's ledger holds, without taking it (a
	// gateway may be appending); an error wrapping fs.ErrNotExist when
	// there is none.
	ReadAll(episode string) ([]byte, error)
	// Remove deletes an episode's ledger; removing none is not an error.
	Remove(episode string) error
}

// Log is one episode's ledger open for appending.
type Log interface {
	// Append stores lines (whole records, each ending in "\n") right after
	// the first at bytes of the ledger, and returns once they are durable.
	// fence is the writer's attempt of the episode. A storage that several
	// writers share refuses, with an error wrapping ErrFenced and storing
	// nothing, a fence below the episode's (Fence) or an at that is not
	// the ledger's length (another writer appended since this one read).
	Append(at int64, lines []byte, fence int) error
	// Fence raises the episode's fence to attempt: from then on, appends
	// with a lower fence are refused, on every node. It fails with
	// ErrFenced when the fence is higher already.
	Fence(attempt int) error
	Close() error
}

// exclusive is a Log that can say it is its ledger's only writer: no one
// else can have appended since it read the ledger (Refresh).
type exclusive interface{ Exclusive() bool }

// sizer is a Storage that can tell a ledger's length without reading it:
// a ledger only grows, by appends at its length, so one whose length is
// what a Ledger read holds what it read (Refresh).
type sizer interface {
	Size(episode string) (int64, error)
}

// ErrFenced: the ledger belongs to a newer attempt of the episode, or
// another gateway has appended to it since this one read it: this writer
// has lost the episode and must stop.
var ErrFenced = errors.New("ledger belongs to another writer")

// ErrUnflushed wraps a write whose outcome is not known (a failed flush, a
// lost connection to the database): the Ledger writes nothing more, and
// must be opened again to find out what its storage holds.
var ErrUnflushed = errors.New("flush failed")

// Files is the Storage of ledger files in a directory: DIR/EPISODE.ledger,
// only ever appended to, flushed to disk (group commit, groupsync.go)
// before an append returns. One process at a time appends to a file: OpenLog
// takes an exclusive flock on it, and a second OpenLog, in this process or
// another, fails with ErrLocked. Fences are kept in memory only: the lock is
// what keeps a second writer out.
type Files string

var _ Storage = Files("")

// Where implements Storage.
func (d Files) Where(episode string) string {
	p, err := Path(string(d), episode)
	if err != nil {
		return fmt.Sprintf("%s (episode %q)", string(d), episode)
	}
	return p
}

// OpenLog implements Storage.
func (d Files) OpenLog(episode string) (Log, []byte, error) {
	dir := string(d)
	path, err := Path(dir, episode)
	if err != nil {
		return nil, nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("ledger directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	created := err == nil
	if errors.Is(err, os.ErrExist) {
		f, err = os.OpenFile(path, os.O_RDWR, 0)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("open ledger: %w", err)
	}
	fail := func(err error) (Log, []byte, error) {
		f.Close()
		return nil, nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fail(fmt.Errorf("ledger %s: %w: another process (or another Open in this one) holds its lock; only one gateway may write an episode's ledger, so close it there first", path, ErrLocked))
		}
		return fail(fmt.Errorf("lock ledger %s: %w", path, err))
	}
	if created {
		if err := atomicfile.SyncDir(dir); err != nil {
			return fail(fmt.Errorf("open ledger: %w", err))
		}
	}
	data, err := readAllFile(f)
	if err != nil {
		return fail(fmt.Errorf("read ledger %s: %w", path, err))
	}
	group, err := groupFor(f)
	if err != nil {
		return fail(fmt.Errorf("open ledger: %w", err))
	}
	return &fileLog{path: path, f: f, size: int64(len(data)), group: group}, data, nil
}

func readAllFile(f *os.File) ([]byte, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	data := make([]byte, fi.Size())
	n, err := f.ReadAt(data, 0)
	if err != nil && n < len(data) {
		return nil, err
	}
	return data[:n], nil
}

// ReadAll implements Storage.
func (d Files) ReadAll(episode string) ([]byte, error) {
	path, err := Path(string(d), episode)
	if err != nil {
		return nil, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("ledger of episode %s: %w", episode, err)
	}
	return data, nil
}

// Remove implements Storage.
func (d Files) Remove(episode string) error {
	path, err := Path(string(d), episode)
	if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// fileLog is a ledger file open for appending, under its flock.
type fileLog struct {
	path  string
	f     *os.File
	size  int64 // the file's length as last written; -1 after a failed write
	fence int
	group *syncGroup
}

func (l *fileLog) Append(at int64, lines []byte, fence int) error {
	if fence < l.fence {
		return fmt.Errorf("ledger %s: %w: attempt %d writes, but attempt %d has taken the episode", l.path, ErrFenced, fence, l.fence)
	}
	if l.size != at {
		// A torn or failed write left bytes after the last whole record.
		if err := l.f.Truncate(at); err != nil {
			return fmt.Errorf("ledger %s: cut away the unfinished last line: %w", l.path, err)
		}
		l.size = at
	}
	if _, err := l.f.WriteAt(lines, at); err != nil {
		l.size = -1
		return fmt.Errorf("ledger %s: write: %w", l.path, err)
	}
	if err := l.group.sync(l.f); err != nil {
		l.size = -1
		return fmt.Errorf("ledger %s: %w: %w", l.path, ErrUnflushed, err)
	}
	l.size = at + int64(len(lines))
	return nil
}

func (l *fileLog) Fence(attempt int) error {
	if attempt < l.fence {
		return fmt.Errorf("ledger %s: %w: attempt %d has taken the episode, not %d", l.path, ErrFenced, l.fence, attempt)
	}
	l.fence = attempt
	return nil
}

// Exclusive implements exclusive: the file's flock keeps every other
// writer out while the log is open.
func (l *fileLog) Exclusive() bool { return true }

func (l *fileLog) Close() error {
	_ = unix.Flock(int(l.f.Fd()), unix.LOCK_UN)
	return l.f.Close()
}

// Dir returns the directory of a Files storage ("" for another storage).
func Dir(s Storage) string {
	if d, ok := s.(Files); ok {
		return filepath.Clean(string(d))
	}
	return ""
}
