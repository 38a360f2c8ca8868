package vmstate

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand"
	"strings"
	"testing"

	"github.com/zeebo/blake3"
)

// guest is a synthetic guest memory: blocks of pages, nil for a zero page.
type guest struct {
	names []string
	pages [][][]byte
}

func newGuest(seed int64, mainPages, zeroEvery int) *guest {
	r := rand.New(rand.NewSource(seed))
	g := &guest{names: []string{"microvm.ram", "pc.bios"}}
	main := make([][]byte, mainPages)
	for i := range main {
		if zeroEvery > 0 && i%zeroEvery != 0 {
			continue
		}
		p := make([]byte, pageSize)
		r.Read(p)
		main[i] = p
	}
	bios := make([][]byte, 16)
	for i := range bios {
		bios[i] = bytes.Repeat([]byte{byte(i + 1)}, pageSize)
	}
	g.pages = [][][]byte{main, bios}
	return g
}

func (g *guest) clone() *guest {
	c := &guest{names: g.names}
	for _, b := range g.pages {
		c.pages = append(c.pages, append([][]byte(nil), b...))
	}
	return c
}

// stream writes g as QEMU 7.2 would for a stopped guest: the header, the
// RAM section's start, its pages in PART sections broken after the page
// counts in breaks (then the rest in the END section), the device state
// and the end mark.
func (g *guest) stream(breaks []int, devices []byte) []byte {
	var b bytes.Buffer
	be32 := func(v uint32) { _ = binary.Write(&b, binary.BigEndian, v) }
	be64 := func(v uint64) { _ = binary.Write(&b, binary.BigEndian, v) }
	str := func(s string) { b.WriteByte(byte(len(s))); b.WriteString(s) }
	be32(fileMagic)
	be32(fileVersion)
	b.WriteByte(secConfig)
	be32(7)
	b.WriteString("microvm")
	b.WriteByte(secStart)
	be32(2)
	str("ram")
	be32(0)
	be32(4)
	var total uint64
	for _, p := range g.pages {
		total += uint64(len(p)) * pageSize
	}
	be64(total | flagMemSize)
	for i, n := range g.names {
		str(n)
		be64(uint64(len(g.pages[i])) * pageSize)
	}
	be64(flagEOS)
	b.WriteByte(secFooter)
	be32(2)
	b.WriteByte(secPart)
	be32(2)
	sent := 0
	next := 0
	for bi, pages := range g.pages {
		for pi, p := range pages {
			if next < len(breaks) && sent == breaks[next] {
				next++
				be64(flagEOS)
				b.WriteByte(secFooter)
				be32(2)
				b.WriteByte(secPart)
				be32(2)
				if next == len(breaks) {
					b.Bytes()[b.Len()-5] = secEnd
				}
			}
			flags := uint64(flagCont)
			if pi == 0 {
				flags = 0
			}
			if p == nil {
				be64(uint64(pi)*pageSize | flags | flagZero)
			} else {
				be64(uint64(pi)*pageSize | flags | flagPage)
			}
			if flags == 0 {
				str(g.names[bi])
			}
			if p == nil {
				b.WriteByte(0)
			} else {
				b.Write(p)
			}
			sent++
		}
	}
	be64(flagEOS)
	b.WriteByte(secFooter)
	be32(2)
	b.WriteByte(secFull)
	be32(3)
	str("cpu")
	be32(0)
	be32(1)
	b.Write(devices)
	b.WriteByte(secEOF)
	return b.Bytes()
}

// split cuts data with a Splitter reading it and with ones over it in
// memory, whole or growing, checks that all cut alike, and returns the
// first's chunks.
func split(t testing.TB, data []byte) ([][]byte, *Splitter) {
	t.Helper()
	all := func(s *Splitter) [][]byte {
		var out [][]byte
		for {
			c, err := s.Next()
			if errors.Is(err, io.EOF) {
				return out
			}
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, c)
		}
	}
	// A producer that has written just what the Splitter waits for, and
	// one that writes odd amounts ahead of it.
	var written int
	exact := func(need int) int { written = max(written, min(need, len(data))); return written }
	var ahead int
	odd := func(need int) int {
		for ahead < need && ahead < len(data) {
			ahead = min(len(data), ahead+1+(ahead*7919)%4099)
		}
		return ahead
	}
	s := NewSplitter(bytes.NewReader(data))
	out := all(s)
	ok, why, pages := s.Parsed()
	for name, m := range map[string]*Splitter{
		"in memory":            NewBytesSplitter(data),
		"growing, exactly":     NewGrowingSplitter(data, exact),
		"growing, odd amounts": NewGrowingSplitter(data, odd),
	} {
		outm := all(m)
		if len(out) != len(outm) {
			t.Fatalf("read, the stream is cut in %d chunks; %s, in %d", len(out), name, len(outm))
		}
		for i := range out {
			if !bytes.Equal(out[i], outm[i]) {
				t.Fatalf("chunk %d differs: %d bytes read, %d %s", i, len(out[i]), len(outm[i]), name)
			}
		}
		okm, whym, pagesm := m.Parsed()
		if ok != okm || why != whym || pages != pagesm {
			t.Fatalf("Parsed: read %v %q %d, %s %v %q %d", ok, why, pages, name, okm, whym, pagesm)
		}
	}
	return out, s
}

func keys(chunks [][]byte) map[[32]byte]int {
	k := map[[32]byte]int{}
	for _, c := range chunks {
		k[blake3.Sum256(c)] = len(c)
	}
	return k
}

// newBytes is what the chunks of b add to a store holding a's.
func newBytes(a, b [][]byte) int {
	ka, n := keys(a), 0
	for k, l := range keys(b) {
		if _, ok := ka[k]; !ok {
			n += l
		}
	}
	return n
}

func TestSplitKeepsTheBytesAndCutsByAddress(t *testing.T) {
	g := newGuest(1, 2048, 3) // 8 MiB, two pages in three zero
	data := g.stream([]int{700, 1500}, bytes.Repeat([]byte("dev"), 5000))
	chunks, s := split(t, data)
	if got := bytes.Join(chunks, nil); !bytes.Equal(got, data) {
		t.Fatalf("the chunks are not the stream: %d bytes, want %d", len(got), len(data))
	}
	ok, why, pages := s.Parsed()
	if !ok || pages != 2048+16 {
		t.Fatalf("Parsed = %v, %q, %d pages; want true and %d pages", ok, why, pages, 2048+16)
	}
	if why != reasonDevices {
		t.Errorf("why = %q, want %q", why, reasonDevices)
	}
	for i, c := range chunks {
		if len(c) > GroupBytes+GroupBytes/16 {
			t.Errorf("chunk %d is %d bytes, more than a group's pages", i, len(c))
		}
	}
	// 8 MiB of main memory is 8 MiB / GroupBytes groups; the breaks, the
	// bios, the header and the devices add a few chunks.
	groups := 8 << 20 / GroupBytes
	if n := len(chunks); n < groups || n > groups+12 {
		t.Errorf("%d chunks, want %d plus a few", n, groups)
	}
}

func TestSecondSaveSharesUnchangedGroups(t *testing.T) {
	g := newGuest(2, 4096, 2) // 16 MiB
	dev := bytes.Repeat([]byte{7}, 3000)
	first, _ := split(t, g.stream([]int{1000, 3000}, dev))

	// The same memory, the sections broken elsewhere: only the chunks
	// around the breaks differ.
	again, _ := split(t, g.stream([]int{1234, 2222, 3999}, dev))
	if n := newBytes(first, again); n > 6*(GroupBytes+GroupBytes/64) {
		t.Errorf("the same memory, other section breaks: %d new bytes, want at most six groups' worth", n)
	}

	// Three pages changed in one group, one zero page written elsewhere,
	// and the device state changed.
	h := g.clone()
	for _, i := range []int{100, 101, 120} {
		p := bytes.Repeat([]byte{byte(i)}, pageSize)
		h.pages[0][i] = p
	}
	h.pages[0][2001] = bytes.Repeat([]byte{9}, pageSize)
	second, _ := split(t, h.stream([]int{1000, 3000}, bytes.Repeat([]byte{8}, 3000)))
	n := newBytes(first, second)
	total := len(bytes.Join(second, nil))
	if n > 3*(GroupBytes+GroupBytes/64)+len(dev)+64 {
		t.Errorf("2 groups changed: %d new bytes of %d", n, total)
	}
	if n < GroupBytes/2 {
		t.Errorf("2 groups changed but only %d new bytes: the change was not stored", n)
	}
}

func TestZeroGroupsMerge(t *testing.T) {
	g := newGuest(3, 8192, 0)
	for i := range g.pages[0] {
		if i%512 != 0 {
			g.pages[0][i] = nil // 32 MiB, one page in 512 written
		}
	}
	chunks, _ := split(t, g.stream(nil, nil))
	for i, c := range chunks[:len(chunks)-2] {
		if len(c) < MinChunk/2 && i > 0 {
			t.Errorf("chunk %d of %d is %d bytes: zero groups should merge up to %d", i, len(chunks), len(c), MinChunk)
		}
	}
}

func TestNotAStreamIsCutAtFixedSizes(t *testing.T) {
	for name, data := range map[string][]byte{
		"garbage":      bytes.Repeat([]byte("not a migration stream "), 30000),
		"other magic":  append([]byte{0x51, 0x45, 0x56, 0x4d, 0, 0, 0, 2}, make([]byte, 1000)...),
		"empty":        nil,
		"short":        []byte("QE"),
		"bad flags":    badFlags(),
		"unknown page": unknownBlock(),
	} {
		t.Run(name, func(t *testing.T) {
			chunks, s := split(t, data)
			if !bytes.Equal(bytes.Join(chunks, nil), data) {
				t.Fatal("the chunks are not the input")
			}
			for _, c := range chunks {
				if len(c) > max(OpaqueChunk, GroupBytes+GroupBytes/16) || len(c) == 0 {
					t.Errorf("a chunk of %d bytes", len(c))
				}
			}
			ok, why, _ := s.Parsed()
			if name == "empty" || name == "short" {
				return
			}
			if ok || why == "" {
				t.Errorf("Parsed = %v, %q: want false and a reason", ok, why)
			}
		})
	}
}

func badFlags() []byte {
	g := newGuest(4, 64, 0)
	data := g.stream(nil, nil)
	// The first page record's header follows the first PART section's
	// header; give it XBZRLE's flag.
	i := bytes.Index(data, []byte("microvm.ram"))
	i = bytes.Index(data[i+20:], []byte{secPart, 0, 0, 0, 2}) + i + 20 + 5
	data[i+7] = 0x40
	return data
}

func unknownBlock() []byte {
	g := newGuest(5, 64, 0)
	data := g.stream(nil, nil)
	i := bytes.LastIndex(data, []byte("pc.bios"))
	copy(data[i:], "pc.biox")
	return data
}

func TestTruncatedStream(t *testing.T) {
	g := newGuest(6, 512, 2)
	data := g.stream([]int{100}, []byte("devices"))
	for _, n := range []int{3, 9, 40, 200, 5000, len(data) / 2, len(data) - 3} {
		chunks, _ := split(t, data[:n])
		if !bytes.Equal(bytes.Join(chunks, nil), data[:n]) {
			t.Errorf("truncated at %d: the chunks are not the prefix", n)
		}
	}
}

type failing struct {
	r   io.Reader
	err error
}

func (f *failing) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err == io.EOF {
		return n, f.err
	}
	return n, err
}

func TestReadErrorEndsTheStream(t *testing.T) {
	g := newGuest(7, 256, 0)
	data := g.stream(nil, nil)
	boom := errors.New("boom")
	s := NewSplitter(&failing{r: bytes.NewReader(data[:len(data)/2]), err: boom})
	var got []byte
	for {
		c, err := s.Next()
		if err != nil {
			if !errors.Is(err, boom) {
				t.Fatalf("err = %v, want boom", err)
			}
			break
		}
		got = append(got, c...)
	}
	if !bytes.Equal(got, data[:len(data)/2]) && !strings.HasPrefix(string(data), string(got)) {
		t.Fatal("the chunks before the error are not the stream's start")
	}
}

func FuzzSplitter(f *testing.F) {
	// Small seeds: the fuzzer slows down badly on large inputs. Two data
	// pages, zero pages, one bios page.
	g := newGuest(8, 40, 20)
	g.pages[1] = g.pages[1][:1]
	f.Add(g.stream([]int{10}, []byte("dev")))
	f.Add(badFlags())
	f.Add([]byte("QEVM"))
	f.Fuzz(func(t *testing.T, data []byte) {
		chunks, s := split(t, data)
		if !bytes.Equal(bytes.Join(chunks, nil), data) {
			t.Fatal("the chunks are not the input")
		}
		for _, c := range chunks {
			if len(c) == 0 || len(c) > MaxChunk+2*pageSize {
				t.Fatalf("a chunk of %d bytes", len(c))
			}
		}
		s.Parsed()
	})
}
