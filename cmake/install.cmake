# `cmake --install BUILD --prefix PREFIX` installs the library only (not apps/, tests or benchmarks):
#   PREFIX/include/capsnet/...            the headers, included as "capsnet/nn/capsule_linear.h"
#   PREFIX/lib/libcapsnet.a               nn, models, data, train, viz (static)
#   PREFIX/lib/libcapsnet_ops.so          the fused operators (their TORCH_LIBRARY registrations)
#   PREFIX/lib/cmake/capsnet/             capsnetConfig.cmake, its version file, the exported targets
# A consumer: find_package(capsnet REQUIRED) + target_link_libraries(app PRIVATE capsnet::capsnet)
# (docs/library.md; tested by install.find_package_consumer, tests/install/).
include(CMakePackageConfigHelpers)

set(CAPSNET_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/capsnet)

# capsnet::capsnet (static), capsnet::ops (libcapsnet_ops.so), capsnet::ops_link (ops with
# --no-as-needed, so that the registrations load even where no symbol of the .so is referenced).
install(TARGETS capsnet capsnet_ops capsnet_ops_link
        EXPORT capsnetTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/capsnet/
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/capsnet
        FILES_MATCHING PATTERN "*.h")
install(EXPORT capsnetTargets
        NAMESPACE capsnet::
        DESTINATION ${CAPSNET_INSTALL_CMAKEDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/capsnetConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/capsnetConfig.cmake
                              INSTALL_DESTINATION ${CAPSNET_INSTALL_CMAKEDIR})
# 0.x: a consumer asking for 0.1 accepts 0.1.z only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/capsnetConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION}
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/capsnetConfig.cmake ${PROJECT_BINARY_DIR}/capsnetConfigVersion.cmake
        DESTINATION ${CAPSNET_INSTALL_CMAKEDIR})
