// The object the test programs' precompiled headers are built with (tests/CMakeLists.txt).
