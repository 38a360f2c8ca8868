package blob

import (
	"bytes"
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
