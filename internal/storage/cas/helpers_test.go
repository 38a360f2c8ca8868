package cas

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"stasis/internal/storage/blob"
)

// memStore is an in-memory blob.Store for tests that tamper with blobs.
type memStore struct {
	mu sync.Mutex
	m  map[string][]byte
}

func newMemStore() *memStore { return &memStore{m: map[string][]byte{}} }

func (s *memStore) Put(_ context.Context, key string, data []byte) error {
	if err := blob.CheckKey(key); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[key]; !ok {
		s.m[key] = bytes.Clone(data)
	}
	return nil
}

func (s *memStore) Get(_ context.Context, key string) ([]byte, error) {
	if err := blob.CheckKey(key); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.m[key]
	if !ok {
		return nil, blob.ErrNotFound
	}
	return bytes.Clone(b), nil
}

func (s *memStore) Has(_ context.Context, key string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[key]
	return ok, nil
}

func (s *memStore) Delete(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, key)
	return nil
}

func (s *memStore) Walk(_ context.Context, fn func(string, int64) error) error {
	s.mu.Lock()
	var keys []string
	for k := range s.m {
		keys = append(keys, k)
	}
	s.mu.Unlock()
	for _, k := range keys {
		s.mu.Lock()
		n := len(s.m[k])
		s.mu.Unlock()
		if err := fn(k, int64(n)); err != nil {
			return err
		}
	}
	return nil
}

// newDirStore is a Store over a fresh blob.Dir, and that directory.
func newDirStore(t *testing.T) (*Store, *blob.Dir) {
	t.Helper()
	d, err := blob.NewDir(filepath.Join(t.TempDir(), "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	return New(d), d
}

// looseStore hides the directory store's batches, so that the cas store
// writes every blob with Put, as a loose file.
type looseStore struct{ blob.Store }

// newLooseStore is a Store over a fresh blob.Dir that keeps every blob in
// a file of its own, and that directory.
func newLooseStore(t *testing.T) (*Store, *blob.Dir) {
	t.Helper()
	d, err := blob.NewDir(filepath.Join(t.TempDir(), "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	return New(looseStore{d}), d
}

// locate is where key's blob is: its file, offset and length.
func locate(t *testing.T, d *blob.Dir, key string) (string, int64, int64) {
	t.Helper()
	f, off, size, err := d.Locate(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	return f, off, size
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

func writeFile(t *testing.T, p string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func isRoot() bool { return os.Geteuid() == 0 }

// setTime sets p's mtime (and atime) without following a symlink.
func setTime(t *testing.T, p string, sec, nsec int64) {
	t.Helper()
	ts := unix.NsecToTimespec(sec*1e9 + nsec)
	must(t, unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW))
}

// makeRichTree builds, under root, a tree with every kind of entry and
// metadata a snapshot keeps or skips, and returns the paths it must skip.
func makeRichTree(t *testing.T, root string) (skipped []string) {
	t.Helper()
	r := rand.New(rand.NewPCG(1, 2))
	j := func(p string) string { return filepath.Join(root, p) }
	writeFile(t, j("small.txt"), []byte("hello\n"))
	writeFile(t, j("empty"), nil)
	writeFile(t, j("big.bin"), randBytes(r, 3<<20+12345)) // several chunks
	writeFile(t, j("a/b/c/deep.txt"), randBytes(r, 70000))
	writeFile(t, j("a/b/sibling"), randBytes(r, 100))
	writeFile(t, j("dup1"), bytes.Repeat([]byte("same content "), 1000))
	writeFile(t, j("a/dup2"), bytes.Repeat([]byte("same content "), 1000)) // same chunk as dup1
	writeFile(t, j("zeros"), make([]byte, 20<<20))                         // repeated identical chunks
	writeFile(t, j("bad\xffname\x01"), []byte("not UTF-8"))                // a name JSON cannot hold as a string
	writeFile(t, j("ünïcødé ☃"), []byte("utf-8"))
	must(t, os.MkdirAll(j("emptydir"), 0o755))
	must(t, os.MkdirAll(j("emptydir2/inner"), 0o700))
	// Hard links: a pair, a triple across directories, one to an empty file.
	writeFile(t, j("hl/one"), []byte("linked twice"))
	must(t, os.Link(j("hl/one"), j("hl/two")))
	writeFile(t, j("hl/tri"), randBytes(r, 5000))
	must(t, os.Link(j("hl/tri"), j("a/tri2")))
	must(t, os.Link(j("hl/tri"), j("a/b/tri3")))
	writeFile(t, j("hl/e0"), nil)
	must(t, os.Link(j("hl/e0"), j("hl/e1")))
	// Symlinks, never followed: relative, absolute, dangling, to a directory,
	// to outside the tree, a name that is not UTF-8.
	must(t, os.Symlink("small.txt", j("link-rel")))
	must(t, os.Symlink("/etc/passwd", j("link-abs")))
	must(t, os.Symlink("does/not/exist", j("link-dangling")))
	must(t, os.Symlink("a/b", j("link-dir")))
	must(t, os.Symlink("../../outside", j("a/link-up")))
	must(t, os.Symlink("t\xfeu", j("link-bad-utf8")))
	// Modes: setuid, setgid, sticky, odd permissions, read-only directory.
	writeFile(t, j("modes/suid"), []byte("#!/bin/sh\n"))
	must(t, unix.Chmod(j("modes/suid"), 0o4755))
	writeFile(t, j("modes/sgid"), []byte("x"))
	must(t, unix.Chmod(j("modes/sgid"), 0o2711))
	writeFile(t, j("modes/none"), []byte("x"))
	if isRoot() { // only root reads it back
		must(t, unix.Chmod(j("modes/none"), 0o000))
	}
	writeFile(t, j("modes/all"), []byte("x"))
	must(t, unix.Chmod(j("modes/all"), 0o7777))
	must(t, os.MkdirAll(j("modes/sticky"), 0o755))
	must(t, unix.Chmod(j("modes/sticky"), 0o1777))
	must(t, os.MkdirAll(j("modes/sgiddir"), 0o755))
	must(t, unix.Chmod(j("modes/sgiddir"), 0o2775))
	writeFile(t, j("modes/ro/inside"), []byte("in a read-only directory"))
	// Ownership other than the caller's (needs root).
	if isRoot() {
		must(t, os.Lchown(j("small.txt"), 1234, 5678))
		must(t, os.Lchown(j("a/b"), 42, 43))
		must(t, os.Lchown(j("link-rel"), 7, 8))
		must(t, os.Lchown(j("modes/suid"), 1000, 1000))
		must(t, unix.Chmod(j("modes/suid"), 0o4755)) // chown cleared it
	}
	// What is skipped: a FIFO, a socket, a device.
	must(t, unix.Mkfifo(j("a/fifo"), 0o600))
	skipped = append(skipped, "a/fifo")
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	must(t, err)
	must(t, unix.Bind(fd, &unix.SockaddrUnix{Name: j("control.sock")}))
	must(t, unix.Close(fd)) // the socket file stays
	skipped = append(skipped, "control.sock")
	if isRoot() {
		must(t, unix.Mknod(j("modes/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
		skipped = append(skipped, "modes/null")
	}
	// Times with nanoseconds on everything, directories last (children
	// first) so that filling them does not move them.
	var all []string
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		all = append(all, p)
		return err
	}))
	for i := len(all) - 1; i >= 0; i-- {
		setTime(t, all[i], 1_600_000_000+int64(i), int64(i*7919+1)%1_000_000_000)
	}
	must(t, unix.Chmod(j("modes/ro"), 0o555))
	setTime(t, j("modes/ro"), 1_500_000_000, 999_999_999)
	sort.Strings(skipped)
	return skipped
}

// nodeInfo is what a test compares of one entry.
type nodeInfo struct {
	Mode    uint32 // st_mode: type and all permission bits
	UID     uint32
	GID     uint32
	Size    int64 // not for directories
	Mtime   int64
	Target  string
	Content [32]byte
}

// scanTree describes every entry under root ("" is the root) and groups
// paths sharing an inode.
func scanTree(t *testing.T, root string) (map[string]nodeInfo, [][]string) {
	t.Helper()
	infos := map[string]nodeInfo{}
	inodes := map[uint64][]string{}
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			rel = ""
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		n := nodeInfo{Mode: st.Mode, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano()}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			n.Size = st.Size
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			n.Content = sha256.Sum256(b)
			inodes[st.Ino] = append(inodes[st.Ino], rel)
		case unix.S_IFLNK:
			n.Size = st.Size
			n.Target, err = os.Readlink(p)
			if err != nil {
				return err
			}
		}
		infos[rel] = n
		return nil
	}))
	var groups [][]string
	for _, g := range inodes {
		if len(g) > 1 {
			sort.Strings(g)
			groups = append(groups, g)
		}
	}
	sort.Slice(groups, func(i, j int) bool { return groups[i][0] < groups[j][0] })
	return infos, groups
}

// compareTrees fails unless restored holds exactly what orig holds, less
// the skipped paths: same entries, lstat fields, link targets, contents and
// hard-link groups.
func compareTrees(t *testing.T, orig, restored string, skipped []string) {
	t.Helper()
	a, ag := scanTree(t, orig)
	b, bg := scanTree(t, restored)
	for _, s := range skipped {
		if _, ok := a[s]; !ok {
			t.Errorf("skipped %q is not in the original tree", s)
		}
		delete(a, s)
	}
	for p, x := range a {
		y, ok := b[p]
		if !ok {
			t.Errorf("%q missing from the restored tree", p)
			continue
		}
		if x != y {
			t.Errorf("%q differs:\n  orig     %+v\n  restored %+v", p, x, y)
		}
	}
	for p := range b {
		if _, ok := a[p]; !ok {
			t.Errorf("%q in the restored tree only", p)
		}
	}
	if strings.Join(flatten(ag), "|") != strings.Join(flatten(bg), "|") {
		t.Errorf("hard-link groups differ:\n  orig     %v\n  restored %v", ag, bg)
	}
}

func flatten(g [][]string) []string {
	var s []string
	for _, x := range g {
		s = append(s, strings.Join(x, ","))
	}
	return s
}

// noSiblings fails if dir holds anything but want (restore temporaries).
func noSiblings(t *testing.T, dir string, want ...string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	must(t, err)
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	sort.Strings(want)
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("%s holds %q, want %q", dir, got, want)
	}
}
