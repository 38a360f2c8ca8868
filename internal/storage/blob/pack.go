package blob

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/blake3"
	"golang.org/x/sys/unix"

	"stasis/internal/fsclock"
)

// Packs. A batch is committed as one pack: DIR/packs/ID.pack holds the
// blobs' bytes back to back, and DIR/packs/ID.idx lists each blob's key,
// offset and length. The index is renamed into place last, so a pack
// without its index is invisible (a crash's leftover, removed by NewDir
// once old). Blobs a Delete removed from a pack that still holds live
// ones are listed in DIR/packs/ID.dead-GEN, rewritten under a new GEN
// each time (the highest is the one that counts); a pack whose every blob
// is dead is removed, and one that is more than half dead is rewritten
// with its live blobs only. Every change to a pack is a change of the
// packs directory (a create, a rename or a removal, never an append), so
// a Dir notices other processes' changes by the directory's mtime alone.

const (
	packsDir = "packs"
	packExt  = ".pack"
	idxExt   = ".idx"
	deadExt  = ".dead-"
	// packLock serialises the rewriting of dead lists across processes.
	packLock = "packs.lock"
)

var (
	idxMagic  = []byte("stasis-pack-index-v1\n")
	deadMagic = []byte("stasis-pack-dead-v1\n")
)

// maxIndex bounds an index or dead list read from disk (64 MiB: about
// 1.7 million blobs in one pack).
const maxIndex = 64 << 20

type rawKey [32]byte

func parseKey(key string) (rawKey, error) {
	var k rawKey
	if err := CheckKey(key); err != nil {
		return k, err
	}
	_, err := hex.Decode(k[:], []byte(key))
	return k, err
}

func (k rawKey) String() string { return hex.EncodeToString(k[:]) }

// parseKeys checks every key of a bulk delete before anything is deleted,
// and that ctx is still live.
func parseKeys(ctx context.Context, keys []string) ([]rawKey, error) {
	raw := make([]rawKey, len(keys))
	for i, key := range keys {
		k, err := parseKey(key)
		if err != nil {
			return nil, err
		}
		raw[i] = k
	}
	return raw, ctx.Err()
}

// packEntry is one blob of a pack.
type packEntry struct {
	key       rawKey
	off, size int64
}

// encodeIndex is the canonical index of entries, which must be in offset
// order without overlaps: the magic, the count, each entry (32-byte key,
// offset and length as uvarints), and the blake3-256 of all that.
func encodeIndex(entries []packEntry) []byte {
	b := append([]byte(nil), idxMagic...)
	b = binary.AppendUvarint(b, uint64(len(entries)))
	for _, e := range entries {
		b = append(b, e.key[:]...)
		b = binary.AppendUvarint(b, uint64(e.off))
		b = binary.AppendUvarint(b, uint64(e.size))
	}
	return seal(b)
}

// seal appends the blake3-256 of b to it.
func seal(b []byte) []byte {
	sum := blake3.Sum256(b)
	return append(b, sum[:]...)
}

// decodeIndex parses an index strictly: only the canonical encoding of
// entries in offset order, without overlaps or repeated keys, is accepted.
func decodeIndex(b []byte) ([]packEntry, error) {
	body, err := checkSum(b, idxMagic, "index")
	if err != nil {
		return nil, err
	}
	n, body, err := uvarint(body, "count")
	if err != nil {
		return nil, err
	}
	if n > uint64(len(body))/34 {
		return nil, fmt.Errorf("pack index: %d entries cannot fit in %d bytes", n, len(body))
	}
	entries := make([]packEntry, 0, n)
	seen := make(map[rawKey]bool, n)
	var end uint64
	for i := uint64(0); i < n; i++ {
		var e packEntry
		if len(body) < 32 {
			return nil, fmt.Errorf("pack index: entry %d is cut short", i)
		}
		copy(e.key[:], body)
		body = body[32:]
		var off, size uint64
		if off, body, err = uvarint(body, "offset"); err != nil {
			return nil, err
		}
		if size, body, err = uvarint(body, "length"); err != nil {
			return nil, err
		}
		if off < end || size > 1<<62 || off > 1<<62 {
			return nil, fmt.Errorf("pack index: entry %d (offset %d, length %d) overlaps the one before or is out of range", i, off, size)
		}
		if seen[e.key] {
			return nil, fmt.Errorf("pack index: blob %s is listed twice", e.key)
		}
		seen[e.key] = true
		end = off + size
		e.off, e.size = int64(off), int64(size)
		entries = append(entries, e)
	}
	if len(body) != 0 {
		return nil, fmt.Errorf("pack index: %d bytes after the last entry", len(body))
	}
	return entries, nil
}

// encodeDead is the canonical dead list of keys: the magic, the count,
// the keys in ascending order, and the blake3-256 of all that.
func encodeDead(keys []rawKey) []byte {
	keys = slices.Clone(keys)
	slices.SortFunc(keys, func(a, b rawKey) int { return bytes.Compare(a[:], b[:]) })
	b := append([]byte(nil), deadMagic...)
	b = binary.AppendUvarint(b, uint64(len(keys)))
	for _, k := range keys {
		b = append(b, k[:]...)
	}
	return seal(b)
}

// decodeDead parses a dead list strictly (ascending keys, each once).
func decodeDead(b []byte) ([]rawKey, error) {
	body, err := checkSum(b, deadMagic, "dead list")
	if err != nil {
		return nil, err
	}
	n, body, err := uvarint(body, "dead list count")
	if err != nil {
		return nil, err
	}
	if n > uint64(len(body))/32 || uint64(len(body)) != n*32 {
		return nil, fmt.Errorf("pack dead list: %d keys do not make %d bytes", n, len(body))
	}
	keys := make([]rawKey, n)
	for i := range keys {
		copy(keys[i][:], body[32*i:])
		if i > 0 && bytes.Compare(keys[i-1][:], keys[i][:]) >= 0 {
			return nil, fmt.Errorf("pack dead list: key %d is out of order or repeated", i)
		}
	}
	return keys, nil
}

func checkSum(b, magic []byte, what string) ([]byte, error) {
	if len(b) < len(magic)+32 || !bytes.Equal(b[:len(magic)], magic) {
		return nil, fmt.Errorf("pack %s: not a stasis pack %s (bad header or cut short)", what, what)
	}
	body, sum := b[:len(b)-32], b[len(b)-32:]
	if got := blake3.Sum256(body); !bytes.Equal(got[:], sum) {
		return nil, fmt.Errorf("pack %s: checksum mismatch (damaged or cut short)", what)
	}
	return body[len(magic):], nil
}

func uvarint(b []byte, what string) (uint64, []byte, error) {
	v, n := binary.Uvarint(b)
	if n <= 0 {
		return 0, nil, fmt.Errorf("pack: bad %s", what)
	}
	if n != len(binary.AppendUvarint(nil, v)) {
		return 0, nil, fmt.Errorf("pack: %s is not minimally encoded", what)
	}
	return v, b[n:], nil
}

// pack is one committed pack as this process last read it.
type pack struct {
	id      string
	entries []packEntry
	gen     int // the dead list's generation; 0: none
	dead    map[rawKey]bool
	bytes   int64 // all entries' bytes
	deadB   int64 // dead entries' bytes
	// S3 only: when its index was stored (by the server's clock), and
	// the names of the dead lists read into dead.
	stored   time.Time
	deadObjs map[string]bool
}

// loc is where a live blob is; next chains the rare other packs that hold
// the same blob (a compaction's copy before its original is gone, or a
// blob two processes stored at once).
type loc struct {
	p         *pack
	off, size int64
	next      *loc
}

// packSet is this process's view of the packs directory, brought up to
// date when the directory's mtime says it changed.
type packSet struct {
	dir   string
	racy  time.Duration
	mu    sync.RWMutex
	packs map[string]*pack
	keys  map[rawKey]*loc
	bad   map[string]bool // indexes found damaged, warned about once
	mtime unix.Timespec   // the directory's mtime at the last scan
	at    time.Time       // when the last scan began
}

func newPackSet(dir string) *packSet {
	return &packSet{dir: dir, racy: fsclock.RacyWindow(), packs: map[string]*pack{}, keys: map[rawKey]*loc{}, bad: map[string]bool{}}
}

// lookup returns where key lives, if in a pack.
func (s *packSet) lookup(k rawKey) (loc, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	l := s.keys[k]
	if l == nil {
		return loc{}, false
	}
	return *l, true
}

// fresh brings the view up to date unless the directory has not changed
// since the last scan (and did not change so close to it that a change in
// the same timestamp tick could hide); force scans regardless.
func (s *packSet) fresh(force bool) error {
	var st unix.Stat_t
	err := unix.Stat(s.dir, &st)
	if errors.Is(err, unix.ENOENT) {
		s.mu.Lock()
		defer s.mu.Unlock()
		for id, p := range s.packs {
			s.drop(p)
			delete(s.packs, id)
		}
		return nil
	}
	if err != nil {
		return &os.PathError{Op: "stat", Path: s.dir, Err: err}
	}
	if !force {
		s.mu.RLock()
		same := st.Mtim == s.mtime && s.at.Sub(time.Unix(st.Mtim.Unix())) > s.racy
		s.mu.RUnlock()
		if same {
			return nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.scan()
}

// scan reads the directory and loads what changed; s.mu is held.
func (s *packSet) scan() error {
	at := time.Now()
	var st unix.Stat_t
	if err := unix.Stat(s.dir, &st); err != nil {
		return &os.PathError{Op: "stat", Path: s.dir, Err: err}
	}
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return fmt.Errorf("blob store packs: %w", err)
	}
	names := packNames(ents)
	for id, p := range s.packs {
		if _, ok := names[id]; !ok {
			s.drop(p)
			delete(s.packs, id)
		}
	}
	for id, n := range names {
		if !n.idx {
			continue
		}
		p := s.packs[id]
		if p != nil && p.gen == n.gen {
			continue
		}
		if p == nil {
			if s.bad[id] {
				continue
			}
			entries, err := readIndex(filepath.Join(s.dir, id+idxExt))
			if errors.Is(err, fs.ErrNotExist) {
				continue // removed since the directory was read
			}
			if err != nil {
				// Its blobs read as absent; the store's reader reports the
				// chunks it misses. Leave the files for a person to see.
				slog.Warn("a pack index cannot be read; its blobs are treated as missing", "index", filepath.Join(s.dir, id+idxExt), "err", err)
				s.bad[id] = true
				continue
			}
			p = &pack{id: id, entries: entries, dead: map[rawKey]bool{}}
			for _, e := range entries {
				p.bytes += e.size
			}
			s.packs[id] = p
		} else {
			s.drop(p)
		}
		p.gen, p.dead, p.deadB = n.gen, map[rawKey]bool{}, 0
		if n.gen > 0 {
			keys, err := readDead(filepath.Join(s.dir, id+deadExt+strconv.Itoa(n.gen)))
			if errors.Is(err, fs.ErrNotExist) {
				// Replaced since the directory was read: the next scan
				// takes the newer list (the directory has changed).
				at = time.Time{}
			} else if err != nil {
				slog.Warn("a pack's dead list cannot be read; its deleted blobs are treated as live", "pack", filepath.Join(s.dir, id+packExt), "err", err)
			}
			in := map[rawKey]int64{}
			for _, e := range p.entries {
				in[e.key] = e.size
			}
			for _, k := range keys {
				if size, ok := in[k]; ok {
					p.dead[k] = true
					p.deadB += size
				}
			}
		}
		s.add(p)
	}
	s.mtime, s.at = st.Mtim, at
	return nil
}

// add makes p's live blobs findable; drop undoes it. s.mu is held.
func (s *packSet) add(p *pack) {
	for _, e := range p.entries {
		if p.dead[e.key] {
			continue
		}
		s.keys[e.key] = &loc{p: p, off: e.off, size: e.size, next: s.keys[e.key]}
	}
}

func (s *packSet) drop(p *pack) {
	for _, e := range p.entries {
		var prev *loc
		for l := s.keys[e.key]; l != nil; prev, l = l, l.next {
			if l.p != p {
				continue
			}
			switch {
			case prev != nil:
				prev.next = l.next
			case l.next != nil:
				s.keys[e.key] = l.next
			default:
				delete(s.keys, e.key)
			}
			break
		}
	}
}

// packName is what the packs directory holds for one pack id.
type packName struct {
	idx, pack bool
	gen       int   // the highest dead list's generation
	gens      []int // every dead list's generation
}

func packNames(ents []os.DirEntry) map[string]*packName {
	names := map[string]*packName{}
	get := func(id string) *packName {
		n := names[id]
		if n == nil {
			n = &packName{}
			names[id] = n
		}
		return n
	}
	for _, e := range ents {
		name := e.Name()
		switch {
		case strings.HasSuffix(name, idxExt) && validPackID(strings.TrimSuffix(name, idxExt)):
			get(strings.TrimSuffix(name, idxExt)).idx = true
		case strings.HasSuffix(name, packExt) && validPackID(strings.TrimSuffix(name, packExt)):
			get(strings.TrimSuffix(name, packExt)).pack = true
		default:
			id, g, ok := strings.Cut(name, deadExt)
			gen, err := strconv.Atoi(g)
			if ok && err == nil && gen > 0 && strconv.Itoa(gen) == g && validPackID(id) {
				n := get(id)
				n.gens = append(n.gens, gen)
				n.gen = max(n.gen, gen)
			}
		}
	}
	return names
}

// validPackID: a pack id is 32 lowercase hex digits.
func validPackID(id string) bool { return len(id) == 32 && lowerHex(id) }

func readIndex(path string) ([]packEntry, error) {
	b, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	return decodeIndex(b)
}

func readDead(path string) ([]rawKey, error) {
	b, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	return decodeDead(b)
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxIndex+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxIndex {
		return nil, fmt.Errorf("%s: over %d bytes", path, maxIndex)
	}
	return b, nil
}

// readAt reads one packed blob. A pack shorter than its index says yields
// the bytes there are, as a damaged loose blob would: the reader's check
// of length and hash reports it.
func readAt(path string, off, size int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, size)
	n, err := f.ReadAt(b, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return b[:n], nil
}
