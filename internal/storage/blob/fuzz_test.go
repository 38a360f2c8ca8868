package blob

import (
	"bytes"
	"path"
	"strings"
	"testing"
)

// FuzzDecodeIndex: a pack index read from disk never panics the decoder,
// and what it accepts is the canonical encoding of entries in offset
// order without overlaps or repeated keys.
func FuzzDecodeIndex(f *testing.F) {
	var k1, k2 rawKey
	k1[0], k2[31] = 0xab, 0xcd
	f.Add(encodeIndex(nil))
	f.Add(encodeIndex([]packEntry{{k1, 0, 10}}))
	f.Add(encodeIndex([]packEntry{{k1, 0, 10}, {k2, 10, 300}}))
	f.Add(encodeIndex([]packEntry{{k1, 5, 1 << 40}}))
	f.Add([]byte("stasis-pack-index-v1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		entries, err := decodeIndex(b)
		if err != nil {
			return
		}
		if again := encodeIndex(entries); !bytes.Equal(again, b) {
			t.Fatalf("accepted a non-canonical index: %x re-encodes as %x", b, again)
		}
		var end int64
		seen := map[rawKey]bool{}
		for _, e := range entries {
			if e.off < end || e.size < 0 || seen[e.key] {
				t.Fatalf("accepted an overlapping, negative or repeated entry: %+v", e)
			}
			end, seen[e.key] = e.off+e.size, true
		}
	})
}

// FuzzDecodeDead: the same for a pack's dead list.
func FuzzDecodeDead(f *testing.F) {
	var k1, k2 rawKey
	k1[0], k2[0] = 1, 2
	f.Add(encodeDead(nil))
	f.Add(encodeDead([]rawKey{k1}))
	f.Add(encodeDead([]rawKey{k2, k1}))
	f.Add(encodeIndex([]packEntry{{k1, 0, 10}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		keys, err := decodeDead(b)
		if err != nil {
			return
		}
		if again := encodeDead(keys); !bytes.Equal(again, b) {
			t.Fatalf("accepted a non-canonical dead list: %x re-encodes as %x", b, again)
		}
	})
}

// FuzzParseS3URL: an s3:// URL from a configuration or a command line
// never panics the parser; what it accepts is a valid bucket and a prefix
// of plain segments, canonical (its String parses back to itself), and
// every object name the store makes under it stays under it.
func FuzzParseS3URL(f *testing.F) {
	for _, s := range []string{
		"s3://bucket", "s3://bucket/", "s3://my-bucket/stasis/blobs", "s3://my.bucket/a/b/",
		"s3://b/../x", "s3://bucket//x", "s3://Bucket/x", "s3://192.168.0.1/x", "s3://bucket/x?y",
		"s3://bucket/%2e%2e/x", "s3://user@bucket/x", "s3://bucket:9000/x", "s3:///x", "s3://bucket/a/./b",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		loc, err := parseS3URL(raw)
		if err != nil {
			if !strings.Contains(err.Error(), "want s3://BUCKET") {
				t.Fatalf("an error that does not say what is wanted: %v", err)
			}
			return
		}
		if err := checkBucketName(loc.bucket); err != nil {
			t.Fatalf("accepted bucket %q: %v", loc.bucket, err)
		}
		again, err := parseS3URL(loc.String())
		if err != nil || again != loc {
			t.Fatalf("%q parses as %+v, whose String %q parses as %+v, %v", raw, loc, loc.String(), again, err)
		}
		if loc.prefix != "" && (!strings.HasSuffix(loc.prefix, "/") || strings.HasPrefix(loc.prefix, "/")) {
			t.Fatalf("prefix %q is not SEG/.../", loc.prefix)
		}
		for _, seg := range strings.Split(strings.TrimSuffix(loc.prefix, "/"), "/") {
			if loc.prefix != "" && (seg == "" || seg == "." || seg == "..") {
				t.Fatalf("prefix %q has segment %q", loc.prefix, seg)
			}
		}
		name := path.Clean("/" + loc.prefix + packObject(strings.Repeat("a", 32)))
		if name != "/"+loc.prefix+packObject(strings.Repeat("a", 32)) {
			t.Fatalf("object name %q under prefix %q is not clean", name, loc.prefix)
		}
	})
}

// FuzzParseS3Name: an object name listed from a bucket never panics the
// parser, and what it takes for the store's is exactly a name it makes.
func FuzzParseS3Name(f *testing.F) {
	id := strings.Repeat("0a", 16)
	for _, s := range []string{packObject(id), indexObject(id), s3DeadDir + id + "/" + id + s3DeadExt, "packs/x.idx", "dead/" + id + "/x.dead", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		n := parseS3Name(name)
		var want string
		switch n.kind {
		case 0:
			return
		case 'p':
			want = packObject(n.id)
		case 'i':
			want = indexObject(n.id)
		case 'd':
			r := strings.TrimSuffix(strings.TrimPrefix(name, s3DeadDir+n.id+"/"), s3DeadExt)
			if !validPackID(r) {
				t.Fatalf("%q taken for a dead list with %q", name, r)
			}
			want = s3DeadDir + n.id + "/" + r + s3DeadExt
		}
		if !validPackID(n.id) || name != want {
			t.Fatalf("%q taken for %c %q", name, n.kind, n.id)
		}
	})
}
