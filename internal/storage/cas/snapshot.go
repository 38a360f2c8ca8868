package cas

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sync"
	"time"

	"github.com/restic/chunker"

	"golang.org/x/sys/unix"
	"stasis/internal/storage/blob"
)

// Snapshot stores the tree rooted at dir and returns its manifest id. prev
// is the id of the previous snapshot of the same tree, or "" for none:
// files whose size, mtime, ctime, inode and device are unchanged since prev
// keep their chunks unread. Everything below dir is stored exactly except
// sockets, FIFOs and devices, which are named in Stats.Skipped. dir itself
// may be a symbolic link to the tree; links inside it are never followed.
// When Snapshot returns, every blob the manifest names and the manifest
// are durable.
//
// The tree should not change while Snapshot reads it (pause what writes to
// it): a file replaced meanwhile fails the snapshot; a file written to
// meanwhile is stored as read and read again by the next snapshot.
func (s *Store) Snapshot(ctx context.Context, dir, prev string) (id string, st Stats, err error) {
	start := time.Now()
	defer func() { st.Duration = time.Since(start) }()
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", st, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	var rootSt unix.Stat_t
	if err := unix.Stat(abs, &rootSt); err != nil {
		return "", st, fmt.Errorf("snapshot %s: %w", abs, &os.PathError{Op: "stat", Path: abs, Err: err})
	}
	if rootSt.Mode&unix.S_IFMT != unix.S_IFDIR {
		return "", st, fmt.Errorf("snapshot %s: not a directory; give the root directory of the tree to store", abs)
	}
	sn := &snapshotter{s: s, claimed: map[string]bool{}, links: map[devIno]name{}}
	if b, ok := s.blobs.(blob.Batcher); ok {
		// New blobs become durable together at the end: two flushes of the
		// file system instead of two per blob.
		sn.batch = b.NewBatch()
		defer sn.batch.Abort() // a no-op after a successful commit
	}
	if prev != "" {
		pm, err := s.loadManifest(ctx, prev)
		if err != nil {
			return "", st, fmt.Errorf("snapshot %s: previous snapshot (pass \"\" for a full snapshot): %w", abs, err)
		}
		sn.prev = indexFiles(pm)
		sn.prevComplete = s.isComplete(prev)
	}

	err = fanOut(ctx, s.workers,
		func(ctx context.Context, jobs chan fileJob) error { return sn.walk(ctx, abs, "", jobs) },
		func() func(context.Context, fileJob) error {
			w := &chunkWorker{} // each worker's own chunk buffers
			return func(ctx context.Context, j fileJob) error { return sn.storeFile(ctx, w, j.abs, j.e) }
		})
	if err != nil {
		return "", st, fmt.Errorf("snapshot %s: %w", abs, err)
	}

	m := &manifest{Root: metaOf(&rootSt), Entries: make([]entry, len(sn.entries))}
	for i, e := range sn.entries {
		m.Entries[i] = *e
		if e.Type == typeFile {
			sn.st.Bytes += e.Size
		}
	}
	b := m.encode()
	id = hashKey(b)
	if err := sn.put(ctx, id, b); err != nil {
		return "", st, fmt.Errorf("snapshot %s: store manifest: %w", abs, err)
	}
	if sn.batch != nil {
		// The manifest and every chunk it names become durable and visible
		// at once.
		if err := sn.batch.Commit(ctx); err != nil {
			return "", st, fmt.Errorf("snapshot %s: %w", abs, err)
		}
	}
	s.setComplete(id)
	return id, sn.st, nil
}

type devIno struct{ dev, ino uint64 }

type fileJob struct {
	abs string
	e   *entry
}

// snapshotter is the state of one Snapshot. The walk (one goroutine) owns
// entries, links and the walk's counts; a file entry handed to a worker is
// the worker's until the workers are done; mu guards claimed and the
// workers' counts.
type snapshotter struct {
	s     *Store
	batch blob.Batch      // nil when the blob store cannot batch
	prev  map[name]*entry // file entries of the previous snapshot, by path (hard links resolved)
	// prevComplete: the previous snapshot's chunks are known to be stored;
	// otherwise each reused file's chunks are checked first.
	prevComplete bool
	entries      []*entry
	links        map[devIno]name // first path of each multiply-linked inode

	// base are the chunk keys of a snapshot the caller's collections keep
	// (StageFile's base): a copy of one of them counts however old it is.
	base map[string]bool

	mu      sync.Mutex
	claimed map[string]bool // chunk keys this snapshot has stored or is storing
	st      Stats
}

// indexFiles maps each file path of m, hard links included, to the file
// entry holding its chunks and fingerprint.
func indexFiles(m *manifest) map[name]*entry {
	idx := make(map[name]*entry, len(m.Entries))
	for i := range m.Entries {
		e := &m.Entries[i]
		switch e.Type {
		case typeFile:
			idx[e.Path] = e
		case typeHardlink:
			idx[e.Path] = idx[e.Target]
		}
	}
	return idx
}

func metaOf(st *unix.Stat_t) meta {
	return meta{Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano()}
}

// walk appends the entries below absDir (whose path in the tree is rel) in
// name order, a directory's entry before its contents, and hands the files
// to read to the workers.
func (sn *snapshotter) walk(ctx context.Context, absDir string, rel name, jobs chan<- fileJob) error {
	ents, err := os.ReadDir(absDir)
	if err != nil {
		return err
	}
	for _, de := range ents {
		if err := ctx.Err(); err != nil {
			return err
		}
		abs := filepath.Join(absDir, de.Name())
		p := name(de.Name())
		if rel != "" {
			p = name(path.Join(string(rel), de.Name()))
		}
		var st unix.Stat_t
		if err := unix.Lstat(abs, &st); err != nil {
			return &os.PathError{Op: "lstat", Path: abs, Err: err}
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			sn.entries = append(sn.entries, &entry{Path: p, Type: typeDir, meta: metaOf(&st)})
			sn.st.Dirs++
			if err := sn.walk(ctx, abs, p, jobs); err != nil {
				return err
			}
		case unix.S_IFLNK:
			target, err := os.Readlink(abs)
			if err != nil {
				return err
			}
			sn.entries = append(sn.entries, &entry{Path: p, Type: typeSymlink, meta: metaOf(&st), Target: name(target)})
			sn.st.Symlinks++
		case unix.S_IFREG:
			if st.Nlink > 1 {
				k := devIno{dev: st.Dev, ino: st.Ino}
				if first, ok := sn.links[k]; ok {
					sn.entries = append(sn.entries, &entry{Path: p, Type: typeHardlink, Target: first})
					sn.st.Hardlinks++
					continue
				}
				sn.links[k] = p
			}
			e := &entry{Path: p, Type: typeFile, meta: metaOf(&st), Size: st.Size, Ino: st.Ino, Dev: st.Dev, Ctime: st.Ctim.Nano()}
			sn.entries = append(sn.entries, e)
			sn.st.Files++
			if old := sn.prev[p]; unchanged(old, e) {
				stored := sn.prevComplete
				if !stored {
					var err error
					if stored, err = sn.allStored(ctx, old.Chunks); err != nil {
						return err
					}
				}
				if stored {
					e.Chunks = old.Chunks
					sn.st.ReusedFiles++
					continue
				}
			}
			select {
			case jobs <- fileJob{abs: abs, e: e}:
			case <-ctx.Done():
				return ctx.Err()
			}
		default: // socket, FIFO, character or block device
			sn.st.Skipped = append(sn.st.Skipped, string(p))
		}
	}
	return nil
}

// unchanged reports whether file entry e, as just seen by lstat, has the
// fingerprint old was stored with.
func unchanged(old, e *entry) bool {
	return old != nil && !old.Racy && old.Size == e.Size && old.Mtime == e.Mtime &&
		old.Ctime == e.Ctime && old.Ino == e.Ino && old.Dev == e.Dev
}

// allStored reports whether every chunk is still in the blob store (a GC
// may have freed the previous snapshot's, or the store been damaged). A
// copy of any age counts (blob.AnyHaver): the previous snapshot is the
// caller's base, which its GC keeps, so a store's refusal to report old
// copies (S3Options.ReuseWithin) would only make every unchanged file be
// read and stored again.
func (sn *snapshotter) allStored(ctx context.Context, refs []chunkRef) (bool, error) {
	has := sn.s.blobs.Has
	if a, ok := sn.s.blobs.(blob.AnyHaver); ok {
		has = a.HasAny
	}
	for _, c := range refs {
		ok, err := has(ctx, c.Key)
		if err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// chunkWorker is one worker's reusable chunker and chunk buffer.
type chunkWorker struct {
	ch  *chunker.Chunker
	buf []byte
}

// storeFile reads, chunks and stores one file, filling in its entry.
func (sn *snapshotter) storeFile(ctx context.Context, w *chunkWorker, abs string, e *entry) error {
	readAt := time.Now()
	// O_NONBLOCK: should the file have been replaced by a FIFO since the
	// walk saw it, the open must not wait for a writer. O_NOATIME: a
	// snapshot leaves the tree as it found it (and reading a file written
	// since its last read would otherwise update its atime in the journal);
	// only the owner or CAP_FOWNER may ask for it.
	const flags = unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC
	fd, err := unix.Open(abs, flags|unix.O_NOATIME, 0)
	if err == unix.EPERM {
		fd, err = unix.Open(abs, flags, 0)
	}
	if err != nil {
		return &os.PathError{Op: "open", Path: abs, Err: err}
	}
	defer unix.Close(fd)
	var before, after unix.Stat_t
	if err := unix.Fstat(fd, &before); err != nil {
		return &os.PathError{Op: "fstat", Path: abs, Err: err}
	}
	if before.Mode&unix.S_IFMT != unix.S_IFREG || before.Ino != e.Ino || before.Dev != e.Dev {
		return fmt.Errorf("%s was replaced while the snapshot was taken; pause whatever writes to the tree, then snapshot again", abs)
	}
	e.meta, e.Size, e.Ctime = metaOf(&before), before.Size, before.Ctim.Nano()
	switch {
	case w.ch == nil && sn.s.minChunk > 0:
		w.ch = chunker.NewWithBoundaries(fdReader(fd), polynomial, sn.s.minChunk, chunker.MaxSize)
	case w.ch == nil:
		w.ch = chunker.New(fdReader(fd), polynomial)
	case sn.s.minChunk > 0:
		w.ch.ResetWithBoundaries(fdReader(fd), polynomial, sn.s.minChunk, chunker.MaxSize)
	default:
		w.ch.Reset(fdReader(fd), polynomial)
	}
	if sn.s.avgBits > 0 {
		w.ch.SetAverageBits(sn.s.avgBits)
	}
	var n int64
	for {
		c, err := w.ch.Next(w.buf)
		if err == io.EOF {
			break
		}
		if err != nil {
			return &os.PathError{Op: "read", Path: abs, Err: err}
		}
		if cap(c.Data) > cap(w.buf) {
			w.buf = c.Data[:0]
		}
		ref := chunkRef{Key: hashKey(c.Data), Size: int64(len(c.Data))}
		if err := sn.put(ctx, ref.Key, c.Data); err != nil {
			return fmt.Errorf("%s: %w", abs, err)
		}
		e.Chunks = append(e.Chunks, ref)
		n += ref.Size
	}
	if err := unix.Fstat(fd, &after); err != nil {
		return &os.PathError{Op: "fstat", Path: abs, Err: err}
	}
	if n != before.Size || after.Size != before.Size || after.Mtim != before.Mtim || after.Ctim != before.Ctim ||
		before.Ctim.Nano() >= readAt.Add(-sn.s.racy).UnixNano() {
		// Changed while read, or so recently that a change within the same
		// timestamp tick would not show: the next snapshot reads it again.
		e.Racy = true
	}
	e.Size = n
	sn.mu.Lock()
	sn.st.ReadBytes += n
	sn.mu.Unlock()
	return nil
}

// put stores a blob unless this snapshot already did or the store has it,
// counting what it writes.
func (sn *snapshotter) put(ctx context.Context, key string, data []byte) error {
	if isNew, err := sn.claim(ctx, key); err != nil || !isNew {
		return err
	}
	var err error
	if sn.batch != nil {
		err = sn.batch.Stage(ctx, key, data)
	} else {
		err = sn.s.blobs.Put(ctx, key, data)
	}
	if err != nil {
		return err
	}
	sn.stored(len(data))
	return nil
}

// claim reports whether key is this snapshot's to store: neither claimed
// by it before nor in the store already.
func (sn *snapshotter) claim(ctx context.Context, key string) (bool, error) {
	sn.mu.Lock()
	if sn.claimed[key] {
		sn.mu.Unlock()
		return false, nil
	}
	sn.claimed[key] = true
	sn.mu.Unlock()
	has := sn.s.blobs.Has
	if a, ok := sn.s.blobs.(blob.AnyHaver); ok && sn.base[key] {
		has = a.HasAny // kept by the base, as allStored's are
	}
	found, err := has(ctx, key)
	return !found && err == nil, err
}

// stored counts a new blob of n bytes.
func (sn *snapshotter) stored(n int) {
	sn.mu.Lock()
	sn.st.NewBlobs++
	sn.st.NewBytes += int64(n)
	sn.mu.Unlock()
}

// fdReader reads a file descriptor, retrying on EINTR.
type fdReader int

func (r fdReader) Read(p []byte) (int, error) {
	for {
		n, err := unix.Read(int(r), p)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 0, err
		}
		if n == 0 && len(p) > 0 {
			return 0, io.EOF
		}
		return n, nil
	}
}
