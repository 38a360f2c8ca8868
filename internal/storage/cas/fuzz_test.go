package cas

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"stasis/internal/storage/blob"
)

// seedManifest is a valid manifest with every entry type and a name that
// is not UTF-8.
func seedManifest() []byte {
	k1, k2 := hashKey([]byte("a")), hashKey([]byte("bb"))
	m := manifest{Root: meta{Mode: 0o755, Mtime: 9}, Entries: []entry{
		{Path: "d", Type: typeDir, meta: meta{Mode: 0o1777, UID: 1, GID: 2, Mtime: -5}},
		{Path: "d/f", Type: typeFile, meta: meta{Mode: 0o4755}, Size: 3, Chunks: []chunkRef{{k1, 1}, {k2, 2}}, Ino: 7, Dev: 8, Ctime: 9},
		{Path: "d/e\xff", Type: typeFile, meta: meta{Mode: 0o600}, Racy: true},
		{Path: "d/h", Type: typeHardlink, Target: "d/f"},
		{Path: "l", Type: typeSymlink, meta: meta{Mode: 0o777}, Target: "../t\xfe"},
	}}
	return m.encode()
}

func FuzzDecodeManifest(f *testing.F) {
	f.Add(seedManifest())
	f.Add(template().encode())
	for _, doc := range badManifests() {
		f.Add(doc)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeManifest(b)
		if err != nil {
			if m != nil {
				t.Fatal("decode returned a manifest with an error")
			}
			return
		}
		// Checked here independently of validate: what a restore relies on.
		types := map[name]string{}
		for _, e := range m.Entries {
			p := string(e.Path)
			if p == "" || p[0] == '/' || strings.IndexByte(p, 0) >= 0 {
				t.Fatalf("accepted path %q", p)
			}
			for _, c := range strings.Split(p, "/") {
				if c == "" || c == "." || c == ".." {
					t.Fatalf("accepted path %q", p)
				}
			}
			if _, dup := types[e.Path]; dup {
				t.Fatalf("accepted duplicate %q", p)
			}
			if i := strings.LastIndexByte(p, '/'); i >= 0 && types[name(p[:i])] != typeDir {
				t.Fatalf("accepted %q before its parent directory", p)
			}
			if e.Mode&^0o7777 != 0 {
				t.Fatalf("accepted mode %#o", e.Mode)
			}
			switch e.Type {
			case typeDir:
			case typeFile:
				var sum int64
				for _, c := range e.Chunks {
					if !blob.ValidKey(c.Key) || c.Size <= 0 {
						t.Fatalf("accepted chunk %+v", c)
					}
					sum += c.Size
				}
				if sum != e.Size {
					t.Fatalf("accepted %q: chunks %d bytes, size %d", p, sum, e.Size)
				}
			case typeSymlink:
				if e.Target == "" || strings.IndexByte(string(e.Target), 0) >= 0 {
					t.Fatalf("accepted symlink target %q", e.Target)
				}
			case typeHardlink:
				if types[e.Target] != typeFile {
					t.Fatalf("accepted hard link %q to %q", p, e.Target)
				}
			default:
				t.Fatalf("accepted type %q", e.Type)
			}
			types[e.Path] = e.Type
		}
		// What is accepted is the canonical encoding of what was decoded.
		if b2 := m.encode(); !bytes.Equal(b, b2) {
			t.Fatalf("accepted bytes are not the canonical encoding of the result")
		}
	})
}

func FuzzChunkVerify(f *testing.F) {
	f.Add([]byte("hello, chunk"), uint32(3), byte(1), uint32(4), "")
	f.Add([]byte{}, uint32(0), byte(0), uint32(0), hashKey(nil))
	f.Add(bytes.Repeat([]byte{0}, 4096), uint32(4095), byte(0x80), uint32(4096), strings.Repeat("f", 64))
	f.Fuzz(func(t *testing.T, data []byte, pos uint32, flip byte, cut uint32, key string) {
		mem := newMemStore()
		ref := chunkRef{Key: hashKey(data), Size: int64(len(data))}
		if err := mem.Put(ctx, ref.Key, data); err != nil {
			t.Fatal(err)
		}
		got, err := readChunk(ctx, mem, ref)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("intact chunk: %v", err)
		}
		corrupt := func(what string, stored []byte) {
			mem.m[ref.Key] = stored
			if _, err := readChunk(ctx, mem, ref); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), ref.Key) {
				t.Fatalf("%s chunk: %v, want ErrCorrupt naming it", what, err)
			}
		}
		if len(data) > 0 {
			if flip != 0 {
				bad := bytes.Clone(data)
				bad[int(pos)%len(bad)] ^= flip
				corrupt("altered", bad)
			}
			corrupt("truncated", data[:int(cut)%len(data)])
		}
		corrupt("extended", append(bytes.Clone(data), byte(cut)))
		delete(mem.m, ref.Key)
		if _, err := readChunk(ctx, mem, ref); !errors.Is(err, ErrCorrupt) || !errors.Is(err, blob.ErrNotFound) {
			t.Fatalf("missing chunk: %v", err)
		}
		// A claimed key and length verify only when both are the data's.
		claim := chunkRef{Key: key, Size: int64(cut)}
		err = verifyChunk(claim, data)
		if want := key == ref.Key && int64(cut) == ref.Size; (err == nil) != want {
			t.Fatalf("verify %+v against %d bytes: %v", claim, len(data), err)
		}
		if err != nil && !errors.Is(err, ErrCorrupt) {
			t.Fatalf("verify error does not wrap ErrCorrupt: %v", err)
		}
		if _, err := readChunk(ctx, mem, claim); err == nil && !(key == ref.Key && int64(cut) == ref.Size) {
			t.Fatal("readChunk accepted a claim it cannot back")
		}
	})
}
