// Package textwrap reflows plain text to a fixed line width.
package textwrap

import (
	"strings"
	"unicode/utf8"
)

// Wrap splits text into lines of at most width characters, breaking only
// between words. Runs of white space collapse to a single space. A word longer
// than width is put on a line of its own and is not split.
func Wrap(text string, width int) []string {
	if width < 1 {
		width = 1
	}
	var (
		lines   []string
		line    strings.Builder
		lineLen int
	)
	for _, word := range strings.Fields(text) {
		wordLen := utf8.RuneCountInString(word)
		if lineLen > 0 && lineLen+1+wordLen > width {
			lines = append(lines, line.String())
			line.Reset()
			lineLen = 0
		}
		if lineLen > 0 {
			line.WriteByte(' ')
			lineLen++
		}
		line.WriteString(word)
		lineLen += wordLen
	}
	if lineLen > 0 {
		lines = append(lines, line.String())
	}
	return lines
}

// Fill is like Wrap but returns the lines joined with newlines, each
// preceded by indent.
func Fill(text string, width int, indent string) string {
	lines := Wrap(text, width)
	for i, l := range lines {
		lines[i] = indent + l
	}
	return strings.Join(lines, "\n")
}
